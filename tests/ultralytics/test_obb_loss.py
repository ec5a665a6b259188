"""FusedOBBLoss against ultralytics' v8OBBLoss on a real YOLOv8n OBBModel: loss, the four items and
the grads of the box, score and angle predictions, on random predictions and rotated labels
(images without labels, a batch without any, a crowded image, labels under 2 pixels that both drop,
angles near the period's ends, class weights, the fallback without padded labels); and no host
sync on a GPU. The loss is torch operations on every device."""

from __future__ import annotations

import math

import pytest
import torch

from tests._helpers import cuda, no_host_sync
from trainfuse.ultralytics import add_padded_targets
from trainfuse.ultralytics.obb_loss import FusedOBBLoss

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 2
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def model():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import OBBModel

    m = OBBModel("yolov8n-obb.yaml", nc=NC, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


def make_inputs(counts, imgsz=(64, 64), tiny=0, angles=None):
    """Predictions and an OBB batch: ``counts[i]`` rotated labels in image i (the first ``tiny`` of
    them under 2 pixels on a side), angles in [0, pi) or the given ones."""
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    A = sum(h * w for h, w in sizes)
    slope = torch.cat([torch.full((h * w,), k) for (h, w), k in zip(sizes, (0.4, 0.8, 1.5))])
    bias = -slope * torch.arange(16.0).repeat(4).view(1, 64, 1)
    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.4 + 0.1
    wh[:tiny] = 1.5 / imgsz[0]
    r = torch.rand(n, 1) * math.pi if angles is None else torch.tensor(angles).view(n, 1)
    batch = {"img": torch.zeros(B, 3, *imgsz), "batch_idx": idx, "cls": torch.randint(0, NC, (n, 1)).float(),
             "bboxes": torch.cat([xy, wh, r], 1)}
    preds = {"boxes": 0.5 * torch.randn(B, 64, A) + bias, "scores": torch.randn(B, NC, A) - 1,
             "angle": (torch.rand(B, 1, A) - 0.25) * math.pi,
             "feats": [torch.zeros(B, 1, h, w) for h, w in sizes]}
    return ({k: v.to(DEVICE) if torch.is_tensor(v) else [f.to(DEVICE) for f in v] for k, v in preds.items()},
            {k: v.to(DEVICE) for k, v in batch.items()})


def run(criterion, preds, batch, upstream):
    leaves = {k: preds[k].detach().clone().requires_grad_() for k in ("boxes", "scores", "angle")}
    loss, items = criterion({**leaves, "feats": preds["feats"]}, dict(batch))
    (loss * upstream).sum().backward()
    grads = [leaves[k].grad for k in ("boxes", "scores", "angle")]
    return loss.detach(), torch.stack(list(items.values())), grads


def assert_matches(got, want):
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    for g, w in zip(got[2], want[2]):
        # grads: fp32 tolerance relative to the tensor's largest grad
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item() + 1e-12)


def tie_free(model, preds, batch) -> bool:
    """Whether ultralytics' assigner keeps top-k choices without ties (see test_loss.py)."""
    from ultralytics.utils.tal import RotatedTaskAlignedAssigner

    calls = []
    original = RotatedTaskAlignedAssigner.select_topk_candidates

    def spy(self, metrics, topk_mask=None):
        top = metrics.topk(self.topk + 1, -1).values
        calls.append(bool(((top[..., -2] > top[..., -1]) | (top[..., -2] == 0)).all()))
        return original(self, metrics, topk_mask)

    RotatedTaskAlignedAssigner.select_topk_candidates = spy
    try:
        ultralytics_loss.v8OBBLoss(model)(preds, batch)
    finally:
        RotatedTaskAlignedAssigner.select_topk_candidates = original
    return all(calls)


def draw(model, counts, **kw):
    for _ in range(50):
        preds, batch = make_inputs(counts, **kw)
        if tie_free(model, preds, batch):
            return preds, batch
    raise AssertionError("no tie-free inputs in 50 draws")


CASES = {"two-images": ([3, 5], {}), "an-image-without-labels": ([4, 0, 2], {}), "no-labels": ([0, 0], {}),
         "crowded-image": ([16, 1], {}), "tiny-labels-drop": ([3, 2], {"tiny": 2}),
         "angles-at-the-period": ([4], {"angles": [0.0, 1e-4, math.pi - 1e-4, math.pi / 2]})}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_v8_obb_loss(case, model):
    counts, kw = CASES[case]
    preds, batch = draw(model, counts, **kw)
    upstream = torch.rand(4, device=DEVICE) + 0.5
    want = run(ultralytics_loss.v8OBBLoss(model), preds, batch, upstream)
    fused = FusedOBBLoss(model)
    got = run(fused, preds, add_padded_targets(dict(batch)), upstream)
    assert_matches(got, want)
    assert_matches(run(fused, preds, batch, upstream), want)  # padded by the loss itself
    assert list(fused(preds, batch)[1]) == ["box_loss", "cls_loss", "dfl_loss", "angle_loss"]
    if sum(counts) == 0:
        assert got[1][0] == 0 and got[1][3] == 0 and got[2][2].abs().max() == 0


def test_class_weights_match(model):
    model.class_weights = torch.tensor([0.5, 2.0], device=DEVICE)
    try:
        preds, batch = draw(model, [2, 3])
        upstream = torch.rand(4, device=DEVICE) + 0.5
        want = run(ultralytics_loss.v8OBBLoss(model), preds, batch, upstream)
        got = run(FusedOBBLoss(model), preds, batch, upstream)
    finally:
        del model.class_weights
    assert_matches(got, want)


def test_wrong_predictions_and_labels_are_refused(model):
    preds, batch = make_inputs([2])
    with pytest.raises(ValueError, match=r"FusedOBBLoss: preds\['boxes'\] must be"):
        FusedOBBLoss(model)({**preds, "angle": preds["angle"][:, :, :5]}, batch)
    batch = add_padded_targets(dict(batch))
    batch["padded_targets"] = batch["padded_targets"][..., :5]
    expected = r"FusedOBBLoss: batch\['padded_targets'\] must have shape \(1, capacity, 6\)"
    with pytest.raises(ValueError, match=expected):
        FusedOBBLoss(model)(preds, batch)


@cuda
def test_no_host_sync_with_padded_labels(model):
    preds, batch = make_inputs([3, 0, 5])
    batch = add_padded_targets({k: v.cpu() for k, v in batch.items()})
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    fused = FusedOBBLoss(model)
    leaves = {k: preds[k].detach().clone().requires_grad_() for k in ("boxes", "scores", "angle")}
    fused({**leaves, "feats": preds["feats"]}, batch)  # warm: anchors cached
    torch.cuda.synchronize()
    with no_host_sync():
        loss, _ = fused({**leaves, "feats": preds["feats"]}, batch)
        loss.sum().backward()
