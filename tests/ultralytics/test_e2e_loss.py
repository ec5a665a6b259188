"""FusedE2ELoss against ultralytics' E2ELoss on real end-to-end DetectionModels (nc=3): yolov10n
(v10Detect, DFL: reg_max 16) and yolo26n (Detect, no DFL: reg_max 1, an L1 term). Loss, items and
the grads of all four prediction tensors (both branches' boxes and scores) on random predictions
and labels (images without labels, a batch without any, a crowded image) and on the heads' own
outputs; the weight schedule over epochs and on resume; the second k of the assigner and the L1
kernels against their torch references. Kernels run through the interpreter on CPU.

Inputs are redrawn until no top-k tie decides either branch's assignment (see test_loss.py)."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import cuda, cuda_kernel_names, no_host_sync, warm_on_side_stream
from tests.ultralytics.test_loss import assert_kernels_match_float64_reference, on_device, tie_free
from trainfuse.losses.detection import assigner as tal
from trainfuse.losses.detection.targets import anchor_grid
from trainfuse.ultralytics import FusedDetectionLoss, FusedE2ELoss, add_padded_targets, takes_fused_e2e_loss
from trainfuse.ultralytics import loss as loss_module

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
YAMLS = ("yolov10n.yaml", "yolo26n.yaml")
BRANCHES = ("one2many", "one2one")
# launches of each of our kernels in a forward and backward: one per branch, topk2 one-to-one only
OURS = {"metric_kernel": 2, "topk_kernel": 2, "resolve_kernel": 2, "topk2_kernel": 1, "scores_kernel": 2,
        "box_loss_fwd_kernel": 2, "cls_loss_fwd_kernel": 2, "box_loss_bwd_kernel": 2,
        "cls_loss_bwd_kernel": 2}


def build(yaml: str):
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    m = DetectionModel(yaml, nc=NC, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


@pytest.fixture(scope="module")
def models():
    return {yaml: build(yaml) for yaml in YAMLS}


@pytest.fixture(params=YAMLS)
def model(request, models):
    return models[request.param]


def branch_preds(B: int, sizes, reg_max: int, dtype=torch.float32) -> dict:
    """One branch's random outputs whose boxes lean to distances of about 12 px on every level,
    so that predicted boxes overlap the labels: DFL logits (as test_loss.py), or for ``reg_max = 1``
    the distances themselves (grid units, 25% noise)."""
    A = sum(h * w for h, w in sizes)
    stride = torch.cat([torch.full((h * w,), s) for (h, w), s in zip(sizes, (8.0, 16.0, 32.0))])
    if reg_max == 1:
        boxes = 12.0 / stride * (1 + 0.25 * torch.randn(B, 4, A))
    else:
        slope = 0.4 * stride / 8
        bias = -slope * torch.arange(float(reg_max)).repeat(4).view(1, 4 * reg_max, 1)
        boxes = 0.5 * torch.randn(B, 4 * reg_max, A) + bias
    scores = torch.randn(B, NC, A) - 1
    return {"boxes": boxes.to(DEVICE, dtype), "scores": scores.to(DEVICE, dtype)}


def labels(counts, imgsz) -> dict:
    """An ultralytics batch with ``counts[i]`` labels in image i."""
    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.4 + 0.15
    return on_device({"img": torch.zeros(len(counts), 3, *imgsz), "batch_idx": idx,
                      "cls": torch.randint(0, NC, (n, 1)).float(), "bboxes": torch.cat([xy, wh], 1)})


def make_inputs(model, counts, imgsz=(64, 64)):
    """Both branches' predictions (one feature list, as the head shares it) and a batch."""
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    feats = [torch.zeros(B, 1, h, w, device=DEVICE) for h, w in sizes]
    reg_max = model.model[-1].reg_max
    preds = {b: {**branch_preds(B, sizes, reg_max), "feats": feats} for b in BRANCHES}
    return preds, labels(counts, imgsz)


def one_branch_inputs(model, counts, imgsz):
    """One branch's predictions and a batch."""
    preds, batch = make_inputs(model, counts, imgsz)
    return preds["one2one"], batch


def draw(loss: FusedE2ELoss | FusedDetectionLoss, make):
    """``make()`` until no top-k tie decides an assignment: of both branches for a FusedE2ELoss,
    of ``make``'s one branch for a FusedDetectionLoss."""
    for _ in range(50):
        preds, batch = make()
        if isinstance(loss, FusedE2ELoss):
            unique = all(tie_free(getattr(loss, b), preds[b], batch) for b in BRANCHES)
        else:
            unique = tie_free(loss, preds, batch)
        if unique:
            return preds, batch
    raise AssertionError("no tie-free inputs in 50 draws")


def run(criterion, preds, batch, upstream=None):
    """loss, items (stacked), their names and the grads of both branches' boxes and scores for
    ``upstream . loss`` (``loss.sum()`` without ``upstream``)."""
    leaves = {b: {k: preds[b][k].detach().clone().requires_grad_() for k in ("boxes", "scores")}
              for b in BRANCHES}
    inputs = {b: {**leaves[b], "feats": preds[b]["feats"]} for b in BRANCHES}
    loss, items = criterion(inputs, dict(batch))
    (loss.sum() if upstream is None else (loss * upstream).sum()).backward()
    grads = [leaves[b][k].grad for b in BRANCHES for k in ("boxes", "scores")]
    return loss.detach(), torch.stack(list(items.values())), list(items), grads


def assert_matches(got, want, grad_rtol=1e-5):
    loss, items, names, grads = got
    assert names == want[2]
    torch.testing.assert_close(items, want[1], rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=0)
    for g, w in zip(grads, want[3]):
        # grads: fp32 tolerance relative to the tensor's largest grad
        torch.testing.assert_close(g.float(), w, rtol=0, atol=grad_rtol * w.abs().max().item() + 1e-12)


# labels per image, image size (h, w): a non-square one tells the L1 term's widths from heights
CASES = {"two-images-64x96": ([3, 5], (64, 96)), "an-image-without-labels": ([4, 0, 2], (64, 64)),
         "no-labels": ([0, 0], (64, 64)), "crowded-image": ([32, 2], (64, 64))}


@pytest.mark.parametrize("counts, imgsz", list(CASES.values()), ids=list(CASES))
def test_matches_e2e_loss(counts, imgsz, path, model):
    """Loss and one-to-one items within 1e-5 relative, grads of both branches' boxes and scores
    within fp32 tolerance, for a random upstream grad on the three terms."""
    fused = FusedE2ELoss(model)
    preds, batch = draw(fused, lambda: make_inputs(model, counts, imgsz))
    upstream = torch.rand(3, device=DEVICE) + 0.5
    want = run(ultralytics_loss.E2ELoss(model), preds, batch, upstream)
    got = run(fused, preds, batch, upstream)
    assert_matches(got, want)
    third = "dfl_loss" if model.model[-1].reg_max > 1 else "l1_loss"
    assert got[2] == ["box_loss", "cls_loss", third] and fused.loss_names == tuple(got[2])
    if sum(counts) == 0:
        assert got[1][0] == 0 and got[1][2] == 0
        assert got[3][0].abs().max() == 0 and got[3][2].abs().max() == 0
    else:
        assert all(g.abs().max() > 0 for g in got[3])


def test_heads_own_outputs_match(kernels, small_blocks, model):
    """The model's training forward (its ``{"one2many", "one2one"}`` dict, a 64 x 96 image: 126
    anchors) through both losses."""
    model.train()
    fused = FusedE2ELoss(model)

    def make():
        batch = labels([3, 1], (64, 96))
        with torch.no_grad():
            preds = model(torch.rand(2, 3, 64, 96, device=DEVICE))
        return preds, batch

    preds, batch = draw(fused, make)
    assert set(preds) == set(BRANCHES)
    assert preds["one2one"]["boxes"].shape == (2, 4 * model.model[-1].reg_max, 126)
    assert_matches(run(fused, preds, batch), run(ultralytics_loss.E2ELoss(model), preds, batch))


def test_weight_schedule_follows_e2e_loss(kernels, small_blocks, model, monkeypatch):
    """Seven epochs' ``update()`` over a 5-epoch run: ``updates``, ``o2m`` and ``o2o`` equal
    E2ELoss's after each (0.8 down to 0.1, then flat); the loss uses them, from one device tensor
    filled in place (what a captured CUDA graph reads)."""
    monkeypatch.setattr(model.args, "epochs", 5)
    stock, fused = ultralytics_loss.E2ELoss(model), FusedE2ELoss(model)
    preds, batch = draw(fused, lambda: make_inputs(model, [3, 4]))
    weights, ptr = fused.weights, fused.weights.data_ptr()
    seen = []
    for epoch in range(7):
        assert (fused.updates, fused.o2m, fused.o2o) == (stock.updates, stock.o2m, stock.o2o)
        assert fused.weights is weights and fused.weights.data_ptr() == ptr
        assert fused.weights.tolist() == torch.tensor([stock.o2m, stock.o2o]).tolist()
        seen.append(round(fused.o2m, 6))
        if epoch in (0, 2, 6):
            assert_matches(run(fused, preds, batch), run(stock, preds, batch))
        stock.update()
        fused.update()
    assert seen == [0.8, 0.625, 0.45, 0.275, 0.1, 0.1, 0.1]


def test_copy_schedule_resumes_where_ultralytics_would(model):
    """ultralytics' resume (``updates = start_epoch - 1``, then ``update()`` on the criterion it
    builds) and a FusedE2ELoss that copies that schedule go on in step."""
    stock, fused = ultralytics_loss.E2ELoss(model), FusedE2ELoss(model)
    stock.updates = 41
    stock.update()
    fused.copy_schedule(stock)
    for _ in range(3):
        assert (fused.updates, fused.o2m, fused.o2o) == (stock.updates, stock.o2m, stock.o2o)
        assert fused.weights.tolist() == torch.tensor([stock.o2m, stock.o2o]).tolist()
        stock.update()
        fused.update()
    assert fused.updates == 45 and 0.1 < fused.o2m < 0.8


def test_labels_are_padded_once_for_both_branches(kernels, small_blocks, model, monkeypatch):
    """A batch without ``padded_targets``: one capacity read (the host sync on a GPU) per call, not
    one per branch; and the same result as a batch padded on the CPU."""
    fused = FusedE2ELoss(model)
    preds, batch = draw(fused, lambda: make_inputs(model, [3, 1]))
    calls = []
    capacity = loss_module.target_capacity
    monkeypatch.setattr(loss_module, "target_capacity", lambda *a, **k: calls.append(1) or capacity(*a, **k))
    plain = run(fused, preds, batch)
    assert len(calls) == 1
    prepared = on_device(add_padded_targets({k: v.cpu() for k, v in batch.items()}, capacity=8))
    padded = run(fused, preds, prepared)
    assert len(calls) == 1
    torch.testing.assert_close((plain[0], plain[1], *plain[3]), (padded[0], padded[1], *padded[3]),
                               rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("topk2", [1, 3])
def test_topk2_kernel_matches_torch_assigner(topk2, kernels, small_blocks, garbage_empty, model):
    """The assignment with a second k (kernels: five launches) against the dense torch assigner,
    with garbage in the outputs before the kernels write them: the same anchors, labels, target
    scores; each ground truth keeps at most ``topk2`` anchors. The inputs are drawn (scores spread
    wide) until the second k drops some ground truth's anchor of largest overlap, so that the
    target scores tell whether their maxima are over the kept anchors."""
    fused = FusedDetectionLoss(model, tal_topk=7, tal_topk2=topk2)
    cfg = fused.assign_config
    M = 8

    def best_overlap(ov, gidx):  # (B, M): each ground truth's largest overlap over its anchors
        return (ov * (gidx[:, None] == torch.arange(M, device=DEVICE).view(1, M, 1))).amax(-1)

    def spread():
        preds, batch = one_branch_inputs(model, [6, 0, 3], (96, 64))
        return {**preds, "scores": 3 * preds["scores"]}, batch

    for _ in range(50):
        preds, batch = draw(fused, spread)
        B, _, A = preds["scores"].shape
        sizes = tuple((f.shape[2], f.shape[3]) for f in preds["feats"])
        anchors, strides = anchor_grid(sizes, fused._strides, DEVICE)
        gt = fused.targets(batch, B, DEVICE)
        assert gt.shape[1] == M
        args = (preds["boxes"], preds["scores"], gt, (96.0, 64.0), anchors, strides.view(-1))
        want = tal.assign_torch(*args, cfg)
        first_only = tal.assign_torch(*args, cfg._replace(topk2=cfg.topk))
        ov = tal.metric_torch(*args, cfg)[1]
        if (best_overlap(ov, want.gidx) < best_overlap(ov, first_only.gidx)).any():
            break
    else:
        raise AssertionError("no inputs in 50 draws where the second k drops an anchor of largest overlap")
    got = tal.assign_kernels(*args, cfg)
    assert torch.equal(got.gidx, want.gidx) and torch.equal(got.label, want.label)
    # t = align * (largest overlap) / (largest align): three factors, each within 1e-5 of torch's
    # (test_loss.py bounds the metric so), so within 3e-5 (as test_loss.py bounds t)
    torch.testing.assert_close(got.t, want.t, rtol=3e-5, atol=1e-9)
    torch.testing.assert_close(got.tss, want.tss, rtol=1e-6, atol=0)
    per_gt = torch.stack([(got.gidx == g).sum(1) for g in range(M)], 1)
    assert per_gt.max() == topk2 and (got.gidx >= 0).sum() < (first_only.gidx >= 0).sum()


@pytest.mark.parametrize("weighted", [False, True])
def test_l1_kernels_match_torch_float64_reference(weighted, kernels, small_blocks, garbage_empty, models):
    """The box+L1 and BCE kernels of a head without DFL against the dense torch terms computed in
    float64, on the one-to-one branch's assignment by the kernels and a 64 x 96 image."""
    model = models["yolo26n.yaml"]
    fused = FusedDetectionLoss(model, tal_topk=7, tal_topk2=1)
    preds, batch = draw(fused, lambda: one_branch_inputs(model, [4, 3, 0], (64, 96)))
    terms = assert_kernels_match_float64_reference(fused, preds, batch, (64.0, 96.0), tal.assign_kernels,
                                                   weighted)
    assert terms[2] > 0


def test_takes_fused_e2e_loss_only_for_end_to_end_detection_models(models):
    from ultralytics.nn.tasks import SegmentationModel

    assert all(takes_fused_e2e_loss(m) for m in models.values())
    assert not takes_fused_e2e_loss(build("yolov8n.yaml"))
    assert not takes_fused_e2e_loss(SegmentationModel("yolo26n-seg.yaml", nc=NC, verbose=False))


def test_wrong_prediction_shapes_are_refused(model):
    preds, batch = make_inputs(model, [1])
    preds["one2one"] = {**preds["one2one"], "scores": preds["one2one"]["scores"][:, :2]}
    with pytest.raises(ValueError, match=r"preds\['boxes'\]"):
        FusedE2ELoss(model)(preds, batch)


def _prepared_step(model):
    """A FusedE2ELoss step on a batch padded on the CPU: ``step(go)`` returns the loss and the
    grads of both branches' boxes and scores for the upstream grad ``go``."""
    fused = FusedE2ELoss(model)
    preds, batch = draw(fused, lambda: make_inputs(model, [3, 6]))
    batch = on_device(add_padded_targets({k: v.cpu() for k, v in batch.items()}))
    leaves = [preds[b][k].requires_grad_() for b in BRANCHES for k in ("boxes", "scores")]

    def step(go):
        loss, _ = fused(preds, batch)
        return (loss.detach(), *torch.autograd.grad(loss, leaves, go))

    return fused, step


@cuda
def test_no_host_sync_and_the_step_replays_as_a_cuda_graph_with_the_new_weights(model):
    """Forward, backward and ``update()`` under torch's sync debug mode "error"; the step captured
    in a CUDA graph replays the eager results, and after an ``update()`` the replay uses the new
    weights without a new capture."""
    fused, step = _prepared_step(model)
    go = torch.rand(3, device=DEVICE) + 0.5
    warm_on_side_stream(step, go)
    with no_host_sync():
        eager = step(go)
        fused.update()
        updated = step(go)
    fused.updates, fused.o2m, fused.o2o = 0, fused.o2m_copy, fused.total - fused.o2m_copy  # the first epoch's
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(go)
    for want in (eager, updated):
        graph.replay()
        torch.cuda.synchronize()
        for got, w in zip(captured, want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-9)
        fused.update()
    assert not torch.equal(eager[0], updated[0])


@cuda
def test_forward_and_backward_launch_our_kernels_and_the_weighted_sum(model):
    """Each branch's assignment and loss kernels (the one-to-one branch's topk2 once), and five
    elementwise launches for the weighted sum (two products and a sum; a product per branch back)."""
    _, step = _prepared_step(model)
    names = cuda_kernel_names(step, torch.ones(3, device=DEVICE))
    for kernel, count in OURS.items():
        assert sum(kernel in n for n in names) == count, (kernel, names)
    assert len(names) == sum(OURS.values()) + 5, ", ".join(names)
