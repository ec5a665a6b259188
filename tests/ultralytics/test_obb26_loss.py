"""FusedE2ELoss over FusedOBBLoss against ultralytics' E2ELoss over v8OBBLoss on a real YOLO26n
OBBModel (an end-to-end head without DFL: the L1 distance term): the loss, its four items and the
grads of every prediction of both branches, on random predictions and rotated labels (an image
without labels, a batch without any, a crowded image)."""

from __future__ import annotations

import math

import pytest
import torch

from trainfuse.ultralytics import add_padded_targets
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss
from trainfuse.ultralytics.obb_loss import FusedOBBLoss

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KEYS = ("boxes", "scores", "angle")


@pytest.fixture(scope="module")
def model():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import OBBModel

    m = OBBModel("yolo26n-obb.yaml", nc=NC, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


def make_inputs(counts, imgsz=(64, 64)):
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    A = sum(h * w for h, w in sizes)
    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.5 + 0.05
    theta = (torch.rand(n, 1) - 0.5) * math.pi * 0.9
    batch = {"img": torch.zeros(B, 3, *imgsz), "batch_idx": idx, "cls": torch.randint(0, NC, (n, 1)).float(),
             "bboxes": torch.cat([xy, wh, theta], 1)}

    def branch():
        return {"boxes": torch.rand(B, 4, A) * 2 + 0.2, "scores": torch.randn(B, NC, A) - 1,
                "angle": (torch.rand(B, 1, A) - 0.5) * math.pi * 0.9,
                "feats": [torch.zeros(B, 1, h, w) for h, w in sizes]}

    def to(v):
        return v.to(DEVICE) if torch.is_tensor(v) else [f.to(DEVICE) for f in v]

    preds = {name: {k: to(v) for k, v in branch().items()} for name in ("one2many", "one2one")}
    return preds, {k: v.to(DEVICE) for k, v in batch.items()}


def run(criterion, preds, batch, upstream):
    leaves = {name: {k: p[k].detach().clone().requires_grad_() for k in KEYS} for name, p in preds.items()}
    given = {name: {**leaves[name], "feats": p["feats"]} for name, p in preds.items()}
    loss, items = criterion(given, dict(batch))
    (loss * upstream).sum().backward()
    grads = [leaves[name][k].grad for name in leaves for k in KEYS]
    return loss.detach(), torch.stack(list(items.values())), grads, list(items)


CASES = {"two-images": [3, 5], "an-image-without-labels": [4, 0, 2], "no-labels": [0, 0],
         "crowded-image": [12, 1]}


@pytest.mark.parametrize("counts", list(CASES.values()), ids=list(CASES))
def test_matches_e2e_obb_loss_without_dfl(counts, model):
    fused = FusedE2ELoss(model, FusedOBBLoss)
    preds, batch = make_inputs(counts)
    upstream = torch.rand(4, device=DEVICE) + 0.5
    want = run(ultralytics_loss.E2ELoss(model, ultralytics_loss.v8OBBLoss), preds, batch, upstream)
    got = run(fused, preds, add_padded_targets(dict(batch)), upstream)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item() + 1e-12)
    assert got[3] == want[3] == ["box_loss", "cls_loss", "l1_loss", "angle_loss"]


def test_background_boxes_with_negative_sides_leave_the_loss_and_grads_finite(model):
    """Without DFL the head's distances are raw: an anchor nobody is assigned to may predict a
    negative side (a 64-pixel run did, 30 steps in). The angle term takes its aspect as 1 there,
    where a NaN multiplied by its zero weight would have stayed NaN, and equals stock's."""
    preds, batch = make_inputs([3, 5])
    for branch in preds.values():
        branch["boxes"] = branch["boxes"] - 1.5  # most sides negative, the foreground's included
    upstream = torch.rand(4, device=DEVICE) + 0.5
    want = run(ultralytics_loss.E2ELoss(model, ultralytics_loss.v8OBBLoss), preds, batch, upstream)
    got = run(FusedE2ELoss(model, FusedOBBLoss), preds, add_padded_targets(dict(batch)), upstream)
    assert torch.isfinite(got[0]).all() and all(torch.isfinite(g).all() for g in got[2])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item() + 1e-12)
