"""FusedDetectionLoss against ultralytics' v8DetectionLoss on a real yolov5n DetectionModel (nc=3):
loss, items and the grads of both prediction tensors, on random predictions and labels (images
without labels, a batch without any, one crowded image, a non-square grid, class weights, 16-bit
predictions, the fallback without padded labels); the kernel pieces against their torch
references on odd shapes; the label padding helpers. Kernels run through the interpreter on CPU.

Where several anchors of a ground truth share the k-th largest alignment metric, which ones
top-k keeps is unspecified (ultralytics' choice is torch.topk's): the inputs here are redrawn
until no such tie decides the assignment (``tie_free``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests._helpers import cuda, cuda_kernel_names, no_host_sync, warm_on_side_stream
from trainfuse.losses.detection import DetectionLossFunction, LossConstants, loss_terms_torch
from trainfuse.losses.detection import assigner as tal
from trainfuse.losses.detection.targets import PADDED_KEY, anchor_grid
from trainfuse.ultralytics import FusedDetectionLoss, add_padded_targets, pad_targets, target_capacity

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = ("metric_kernel", "topk_kernel", "resolve_kernel", "scores_kernel", "box_loss_fwd_kernel",
           "cls_loss_fwd_kernel", "box_loss_bwd_kernel", "cls_loss_bwd_kernel")


@pytest.fixture(scope="module")
def model():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    m = DetectionModel("yolov5n.yaml", nc=NC, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


def make_inputs(counts, imgsz=(64, 64), dtype=torch.float32):
    """Predictions and an ultralytics batch: ``counts[i]`` labels in image i. Box logits lean to
    distances of about 12 px on every level, so that predicted boxes overlap the labels (a
    positive CIoU, hence a positive metric, on most anchors inside a label)."""
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    A = sum(h * w for h, w in sizes)
    slope = torch.cat([torch.full((h * w,), k) for (h, w), k in zip(sizes, (0.4, 0.8, 1.5))])
    bias = -slope * torch.arange(16.0).repeat(4).view(1, 64, 1)
    boxes = (0.5 * torch.randn(B, 64, A) + bias).to(DEVICE, dtype)
    scores = (torch.randn(B, NC, A) - 1).to(DEVICE, dtype)
    feats = [torch.zeros(B, 1, h, w, device=DEVICE) for h, w in sizes]
    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.4 + 0.15
    batch = {"img": torch.zeros(B, 3, *imgsz), "batch_idx": idx, "cls": torch.randint(0, NC, (n, 1)).float(),
             "bboxes": torch.cat([xy, wh], 1)}
    return {"boxes": boxes, "scores": scores, "feats": feats}, on_device(batch)


def on_device(batch):
    return {k: v.to(DEVICE) for k, v in batch.items()}


def tie_free(loss: FusedDetectionLoss, preds, batch) -> bool:
    """Whether top-k's choice is unique in every label's row: the k-th largest metric beats the
    next, or every in-box anchor has a positive metric (zeros outside boxes are dropped anyway)."""
    B, _, A = preds["scores"].shape
    sizes = tuple((f.shape[2], f.shape[3]) for f in preds["feats"])
    anchors, strides = anchor_grid(sizes, loss._strides, DEVICE)
    gt = loss.targets(batch, B, DEVICE)
    imgsz = (sizes[0][0] * 8.0, sizes[0][1] * 8.0)
    align, _, cand = tal.metric_torch(preds["boxes"].float(), preds["scores"].float(), gt, imgsz, anchors,
                                      strides.view(-1), loss.assign_config)
    top = align.topk(loss.assign_config.topk + 1, -1).values
    unique = (top[..., -2] > top[..., -1]) | ~((align == 0) & cand).any(-1)
    return bool(unique[cand.any(-1)].all())


def draw(loss, counts, **kw):
    for _ in range(50):
        preds, batch = make_inputs(counts, **kw)
        if tie_free(loss, preds, batch):
            return preds, batch
    raise AssertionError("no tie-free inputs in 50 draws")


def run(criterion, preds, batch, upstream=None):
    """loss, items (stacked) and the grads of boxes and scores for ``upstream . loss`` (of
    ``loss.sum()`` without ``upstream``: an expanded, stride-0 grad)."""
    leaves = {k: preds[k].detach().clone().requires_grad_() for k in ("boxes", "scores")}
    loss, items = criterion({**leaves, "feats": preds["feats"]}, dict(batch))
    (loss.sum() if upstream is None else (loss * upstream).sum()).backward()
    return loss.detach(), torch.stack(list(items.values())), leaves["boxes"].grad, leaves["scores"].grad


def assert_matches(got, want, grad_rtol=1e-5):
    loss, items, gb, gs = got
    torch.testing.assert_close(items, want[1], rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=0)
    for g, w in ((gb, want[2]), (gs, want[3])):
        # grads: fp32 tolerance relative to the tensor's largest grad
        torch.testing.assert_close(g.float(), w, rtol=0, atol=grad_rtol * w.abs().max().item() + 1e-12)


CASES = {"two-images": [3, 5], "an-image-without-labels": [4, 0, 2], "no-labels": [0, 0],
         "crowded-image": [16, 1]}


@pytest.mark.parametrize("counts", list(CASES.values()), ids=list(CASES))
def test_matches_v8_detection_loss(counts, path, model):
    """Items within 1e-5 relative, grads of both prediction tensors within fp32 tolerance, for a
    random upstream grad on the three terms."""
    fused = FusedDetectionLoss(model)
    preds, batch = draw(fused, counts)
    upstream = torch.rand(3, device=DEVICE) + 0.5
    want = run(ultralytics_loss.v8DetectionLoss(model), preds, batch, upstream)
    got = run(fused, preds, batch, upstream)
    assert_matches(got, want)
    assert list(fused(preds, batch)[1]) == ["box_loss", "cls_loss", "dfl_loss"]
    if sum(counts) == 0:
        assert got[1][0] == 0 and got[1][2] == 0 and got[2].abs().max() == 0


def test_non_square_grid_and_class_weights_match(path, model):
    """A 64 x 96 image (126 anchors, not a multiple of any block) and per-class weights."""
    model.class_weights = torch.tensor([0.5, 2.0, 1.5], device=DEVICE)
    try:
        fused = FusedDetectionLoss(model)
        preds, batch = draw(fused, [2, 6, 1], imgsz=(64, 96))
        want = run(ultralytics_loss.v8DetectionLoss(model), preds, batch)
        got = run(fused, preds, batch)
    finally:
        del model.class_weights
    assert_matches(got, want)


def test_second_topk_matches(kernels, small_blocks, model):
    """``tal_topk2 < tal_topk`` (the assigner's topk2 kernel after the first four)."""
    fused = FusedDetectionLoss(model, tal_topk=10, tal_topk2=4)
    preds, batch = draw(fused, [3, 5])
    want = run(ultralytics_loss.v8DetectionLoss(model, tal_topk=10, tal_topk2=4), preds, batch)
    assert_matches(run(fused, preds, batch), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_predictions_compute_in_float32(dtype, kernels, small_blocks, model):
    """16-bit predictions give ultralytics' float32 result on the same values (upcast), and their
    grads come back in the predictions' dtype."""
    fused = FusedDetectionLoss(model)
    low, batch = draw(fused, [3, 2], dtype=dtype)
    upcast = {**low, "boxes": low["boxes"].float(), "scores": low["scores"].float()}
    want = run(ultralytics_loss.v8DetectionLoss(model), upcast, batch)
    got = run(fused, low, batch)
    assert got[2].dtype == got[3].dtype == dtype
    assert_matches(got, want, grad_rtol=1e-2)


def test_padded_batch_and_fallback_give_the_same_loss(kernels, small_blocks, model):
    """A batch prepared on the CPU (``add_padded_targets``, capacity 8) and one without the padded
    labels (capacity found from batch_idx) give identical results."""
    fused = FusedDetectionLoss(model)
    preds, batch = draw(fused, [3, 1])
    plain = run(fused, preds, batch)
    prepared = on_device(add_padded_targets({k: v.cpu() for k, v in batch.items()}, capacity=8))
    assert prepared[PADDED_KEY].shape == (2, 8, 5)
    padded = run(fused, preds, prepared)
    for a, b in zip(plain, padded):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_assigner_kernels_match_torch(kernels, small_blocks, garbage_empty, model):
    """The assignment pieces against the dense torch assigner, on several images and labels, with
    garbage in the outputs before the kernels write them; a second call (on a GPU, the cached
    launcher's direct relaunch) gives the same."""
    fused = FusedDetectionLoss(model)
    preds, batch = draw(fused, [5, 0, 3], imgsz=(96, 64))
    B, _, A = preds["scores"].shape
    sizes = tuple((f.shape[2], f.shape[3]) for f in preds["feats"])
    anchors, strides = anchor_grid(sizes, fused._strides, DEVICE)
    gt = fused.targets(batch, B, DEVICE)
    args = (preds["boxes"], preds["scores"], gt, (96.0, 64.0), anchors, strides.view(-1), fused.assign_config)
    align, ov, cand, _, _ = tal.metric(*args)
    ref_align, ref_ov, ref_cand = tal.metric_torch(*args)
    assert torch.equal(cand.bool(), ref_cand)
    # CIoU = IoU - (rho2 / c2 + v * alpha) cancels: a few float32 ulps of its terms (the GPU's
    # atan and fused multiply-adds against torch's) reach ~2e-7 absolute on values ~0.05
    torch.testing.assert_close(ov, ref_ov, rtol=1e-5, atol=5e-7)
    torch.testing.assert_close(align, ref_align, rtol=1e-5, atol=1e-9)
    got, want = tal.assign_kernels(*args), tal.assign_torch(*args)
    assert torch.equal(got.gidx, want.gidx) and torch.equal(got.label, want.label)
    assert (got.gidx >= 0).sum() > 0
    # t = align * max overlap / max align per label: the three quantities' 1e-5 add up (one
    # element of 378 was 1.3e-5 apart, on one seed)
    torch.testing.assert_close(got.t, want.t, rtol=3e-5, atol=1e-9)
    torch.testing.assert_close(got.tss, want.tss, rtol=1e-6, atol=0)
    again = tal.assign_kernels(*args)
    for a, b in zip(again, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weighted", [False, True])
def test_loss_kernels_match_torch_float64_reference(weighted, kernels, small_blocks, garbage_empty, model):
    """The box+DFL and BCE kernels against the dense torch terms computed in float64."""
    fused = FusedDetectionLoss(model)
    preds, batch = draw(fused, [4, 3, 0])
    assert_kernels_match_float64_reference(fused, preds, batch, (64.0, 64.0), tal.assign_torch, weighted)


def test_box_backward_making_each_sides_softmax_again_gives_the_same_grads(kernels, small_blocks,
                                                                           garbage_empty, model, monkeypatch):
    """TRAINFUSE_BOX_RECOMPUTE's backward (each side's softmax made again next to its grad, opt-in)
    writes the grads of the default backward bit for bit, and matches float64 as it does."""
    from trainfuse.losses.detection import box_loss

    fused = FusedDetectionLoss(model)
    preds, batch = draw(fused, [4, 3, 0])
    grads = []
    for again in (False, True):
        monkeypatch.setattr(box_loss, "RECOMPUTE_SOFTMAX", again)
        grads.append(assert_kernels_match_float64_reference(fused, preds, batch, (64.0, 64.0),
                                                            tal.assign_torch, False, grads=True))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def assert_kernels_match_float64_reference(fused: FusedDetectionLoss, preds, batch, imgsz, assign,
                                           weighted: bool, grads: bool = False):
    """DetectionLossFunction (the box and class loss kernels) against :func:`loss_terms_torch` in
    float64 on ``assign``'s assignment: terms within 1e-5 relative, grads of both prediction
    tensors within 1e-5 of their largest, for gains and an upstream grad other than ones (class
    weights if ``weighted``). Returns the float64 terms (with ``grads``: the kernels' grads of the
    boxes and the scores)."""
    B, _, A = preds["scores"].shape
    sizes = tuple((f.shape[2], f.shape[3]) for f in preds["feats"])
    anchors, strides = anchor_grid(sizes, fused._strides, DEVICE)
    gt = fused.targets(batch, B, DEVICE)
    asg = assign(preds["boxes"], preds["scores"], gt, imgsz, anchors, strides.view(-1), fused.assign_config)
    cw = torch.tensor([0.3, 1.0, 2.5], device=DEVICE) if weighted else None
    gains, up = (7.5, 0.5, 1.5), torch.tensor([0.7, 1.3, 0.9], device=DEVICE)
    b = preds["boxes"].clone().requires_grad_()
    s = preds["scores"].clone().requires_grad_()
    k = LossConstants(*imgsz, gains, float(B), fused.reg_max - 1 - 0.01)
    out, items = DetectionLossFunction.apply(b, s, asg, gt, anchors, strides.view(-1), cw, k)
    (out * up).sum().backward()
    b64 = preds["boxes"].double().requires_grad_()
    s64 = preds["scores"].double().requires_grad_()
    asg64 = asg._replace(t=asg.t.double(), tss=asg.tss.double())
    terms = loss_terms_torch(b64, s64, asg64, gt.double(), imgsz, anchors.double(),
                             strides.view(-1).double(), None if cw is None else cw.double())
    terms = terms * torch.tensor(gains, dtype=torch.float64, device=DEVICE)
    (terms * B * up.double()).sum().backward()
    torch.testing.assert_close(items.double(), terms.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.double(), terms.detach() * B, rtol=1e-5, atol=0)
    for g, w in ((b.grad, b64.grad), (s.grad, s64.grad)):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-5 * w.abs().max().item())
    assert b.grad.abs().max() > 0 and s.grad.abs().max() > 0
    return (b.grad, s.grad) if grads else terms.detach()


@pytest.mark.parametrize("anchors", [84, 37, 300])
def test_topk_kernel_keeps_the_k_largest_and_the_lowest_index_on_ties(anchors, kernels):
    """Distinct metrics: the same anchors as torch.topk; equal metrics at the k-th place: the
    lowest indices."""
    align = torch.rand(3, 2, anchors, device=DEVICE)
    align[0, 1, :anchors // 2] = 0.0  # zeros, as outside the boxes
    torch.testing.assert_close(tal.topk_mask(align, 10), tal.topk_mask_torch(align, 10), rtol=0, atol=0)
    tied = torch.zeros(1, 1, anchors, device=DEVICE)
    tied[0, 0, [3, 5, 9, 20]] = torch.tensor([0.5, 0.9, 0.5, 0.5], device=DEVICE)
    sel = tal.topk_mask(tied, 3)[0, 0]
    assert sel.nonzero().flatten().tolist() == [3, 5, 9]
    zeros = torch.zeros(1, 1, anchors, device=DEVICE)
    assert tal.topk_mask(zeros, 2)[0, 0].nonzero().flatten().tolist() == [0, 1]


def test_target_capacity_is_the_largest_count_as_a_power_of_two():
    idx = torch.tensor([0, 0, 2, 2, 2, 1.0])
    assert target_capacity(idx, 3) == 4
    assert target_capacity(idx, 3, bucket=False) == 3
    assert target_capacity(torch.zeros(0), 5) == 1
    assert target_capacity(torch.zeros(5), 1) == 8


def test_pad_targets_keeps_each_images_labels_in_batch_order():
    idx = torch.tensor([1, 0, 1, 1, 0.0])
    cls = torch.arange(5.0)
    boxes = torch.rand(5, 4)
    out = pad_targets(idx, cls, boxes, 3, 4)
    assert out.shape == (3, 4, 5)
    want = torch.zeros(3, 4, 5)
    for img in range(3):
        rows = [i for i in range(5) if idx[i] == img]
        for r, i in enumerate(rows):
            want[img, r] = torch.cat([cls[i:i + 1], boxes[i]])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="bboxes shape"):
        pad_targets(idx, cls, boxes[:3], 3, 4)


def test_wrong_prediction_shapes_are_refused(model):
    preds, batch = make_inputs([1])
    with pytest.raises(ValueError, match=r"preds\['boxes'\]"):
        FusedDetectionLoss(model)({**preds, "scores": preds["scores"][:, :2]}, batch)


def _prepared_step(model):
    """A FusedDetectionLoss step on a batch padded on the CPU: ``step(go)`` returns the loss and the
    grads of both prediction tensors for the upstream grad ``go``."""
    fused = FusedDetectionLoss(model)
    preds, batch = draw(fused, [3, 6])
    batch = on_device(add_padded_targets({k: v.cpu() for k, v in batch.items()}))
    leaves = (preds["boxes"].requires_grad_(), preds["scores"].requires_grad_())

    def step(go):
        loss, _ = fused(preds, batch)
        return (loss.detach(), *torch.autograd.grad(loss, leaves, go))

    return step


@cuda
def test_no_host_sync_and_the_step_replays_as_a_cuda_graph(model):
    """Forward and backward under torch's sync debug mode "error", then captured in a CUDA graph
    whose replay gives the eager results."""
    step = _prepared_step(model)
    go = torch.rand(3, device=DEVICE) + 0.5
    warm_on_side_stream(step, go)
    with no_host_sync():
        eager = step(go)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(go)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@cuda
def test_forward_and_backward_launch_our_eight_kernels_and_nothing_else(model):
    step = _prepared_step(model)
    names = cuda_kernel_names(step, torch.ones(3, device=DEVICE))
    assert len(names) == len(KERNELS), ", ".join(names)
    for k in KERNELS:
        assert sum(k in n for n in names) == 1, (k, names)


def test_importing_trainfuse_ultralytics_does_not_import_ultralytics():
    code = "import sys, trainfuse, trainfuse.ultralytics; assert 'ultralytics' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
