"""FusedE2ELoss over FusedPose26Loss against ultralytics' E2ELoss over PoseLoss26 on a real YOLO26n
PoseModel (an end-to-end head without DFL, with a flow model for the RLE term): the loss, its six
items and the grads of every prediction of both branches (boxes, scores, keypoints, keypoint
sigmas), on random predictions and labels (an image without labels, a batch without any, a crowded
image, keypoints not labelled or occluded, COCO's 17 keypoints with their RLE weights), through the
detection kernels (the interpreter on CPU) and the dense torch path."""

from __future__ import annotations

import pytest
import torch

from trainfuse.ultralytics import add_padded_targets
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss
from trainfuse.ultralytics.pose26_loss import FusedPose26Loss

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 2
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KEYS = ("boxes", "scores", "kpts", "kpts_sigma")
NAMES = ["box_loss", "pose_loss", "kobj_loss", "cls_loss", "l1_loss", "rle_loss"]


def pose26_model(kpt_shape=(4, 3)):
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import PoseModel

    m = PoseModel("yolo26n-pose.yaml", nc=NC, data_kpt_shape=kpt_shape, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


@pytest.fixture(scope="module")
def model():
    return pose26_model()


def make_inputs(counts, kpt_shape=(4, 3), imgsz=(64, 64)):
    """Both branches' predictions and a pose batch: ``counts[i]`` labels in image i, keypoints
    inside their box, about a third of them with visibility 0 or 1; box sizes from 3 to 40 pixels,
    so that the level gate opens each pyramid level to some."""
    K, D = kpt_shape
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    A = sum(h * w for h, w in sizes)

    def branch():
        return {"boxes": torch.rand(B, 4, A) * 2 + 0.2, "scores": torch.randn(B, NC, A) - 1,
                "kpts": torch.randn(B, K * D, A) * 0.5, "kpts_sigma": torch.randn(B, K * 2, A),
                "feats": [torch.zeros(B, 1, h, w) for h, w in sizes]}

    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.6 + 0.05
    inside = xy.view(n, 1, 2) + (torch.rand(n, K, 2) - 0.5) * wh.view(n, 1, 2)
    keypoints = inside if D == 2 else torch.cat((inside, torch.randint(0, 3, (n, K, 1)).float()), -1)
    batch = {"img": torch.zeros(B, 3, *imgsz), "batch_idx": idx, "cls": torch.randint(0, NC, (n, 1)).float(),
             "bboxes": torch.cat([xy, wh], 1), "keypoints": keypoints}

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


def assert_matches(got, want):
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item() + 1e-12)
    assert got[3] == want[3]


CASES = {"two-images": [3, 5], "an-image-without-labels": [4, 0, 2], "no-labels": [0, 0],
         "crowded-image": [12, 1]}


@pytest.mark.parametrize("counts", list(CASES.values()), ids=list(CASES))
def test_matches_e2e_pose_loss_26(counts, path, model):
    fused = FusedE2ELoss(model, FusedPose26Loss)
    preds, batch = make_inputs(counts)
    upstream = torch.rand(6, device=DEVICE) + 0.5
    want = run(ultralytics_loss.E2ELoss(model, ultralytics_loss.PoseLoss26), preds, batch, upstream)
    got = run(fused, preds, add_padded_targets(dict(batch)), upstream)
    assert_matches(got, want)
    assert got[3] == NAMES
    if sum(counts) == 0:
        assert (got[1][1:3] == 0).all() and got[1][5] == 0


def test_coco_keypoints_take_their_rle_weights_and_match():
    model = pose26_model((17, 3))
    fused = FusedE2ELoss(model, FusedPose26Loss)
    preds, batch = make_inputs([3, 2], kpt_shape=(17, 3))
    upstream = torch.rand(6, device=DEVICE) + 0.5
    want = run(ultralytics_loss.E2ELoss(model, ultralytics_loss.PoseLoss26), preds, batch, upstream)
    assert_matches(run(fused, preds, add_padded_targets(dict(batch)), upstream), want)
    from ultralytics.utils.metrics import RLE_WEIGHT

    assert torch.equal(fused.one2one.rle_weights.cpu(), torch.as_tensor(RLE_WEIGHT))


def test_the_graphs_take_the_padded_keypoints(model):
    assert FusedE2ELoss(model, FusedPose26Loss).graph_keys == ("padded_targets", "padded_keypoints")
