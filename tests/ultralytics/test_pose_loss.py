"""FusedPoseLoss against ultralytics' v8PoseLoss on a real YOLOv8n PoseModel: loss, the five items
and the grads of the box, score and keypoint predictions, on random predictions and labels
(images without labels, a batch without any, a crowded image, keypoints not labelled (visibility
0) or labelled occluded (1), a head without visibility, COCO's 17 keypoints with their sigmas, the
fallback without padded labels), through the detection kernels (the interpreter on CPU) and the
dense torch path; and no host sync on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import cuda, no_host_sync
from tests.ultralytics.test_loss import tie_free
from trainfuse.ultralytics import add_padded_targets
from trainfuse.ultralytics.pose_loss import FusedPoseLoss

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 2
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pose_model(kpt_shape=(4, 3)):
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import PoseModel

    m = PoseModel("yolov8n-pose.yaml", nc=NC, data_kpt_shape=kpt_shape, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


@pytest.fixture(scope="module")
def model():
    return pose_model()


def make_inputs(counts, kpt_shape=(4, 3), imgsz=(64, 64)):
    """Predictions and a pose batch: ``counts[i]`` labels in image i, each with keypoints inside
    its box, about a third of them with visibility 0 or 1 (where the labels have visibility)."""
    K, D = kpt_shape
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    A = sum(h * w for h, w in sizes)
    slope = torch.cat([torch.full((h * w,), k) for (h, w), k in zip(sizes, (0.4, 0.8, 1.5))])
    bias = -slope * torch.arange(16.0).repeat(4).view(1, 64, 1)
    boxes = 0.5 * torch.randn(B, 64, A) + bias
    scores = torch.randn(B, NC, A) - 1
    kpts = torch.randn(B, K * D, A)
    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.4 + 0.15
    inside = xy.view(n, 1, 2) + (torch.rand(n, K, 2) - 0.5) * wh.view(n, 1, 2)
    keypoints = inside if D == 2 else torch.cat((inside, torch.randint(0, 3, (n, K, 1)).float()), -1)
    batch = {"img": torch.zeros(B, 3, *imgsz), "batch_idx": idx, "cls": torch.randint(0, NC, (n, 1)).float(),
             "bboxes": torch.cat([xy, wh], 1), "keypoints": keypoints}
    preds = {"boxes": boxes, "scores": scores, "kpts": kpts,
             "feats": [torch.zeros(B, 1, h, w) for h, w in sizes]}
    return {k: v.to(DEVICE) if torch.is_tensor(v) else [f.to(DEVICE) for f in v] for k, v in preds.items()}, \
        {k: v.to(DEVICE) for k, v in batch.items()}


def draw(loss, counts, **kw):
    for _ in range(50):
        preds, batch = make_inputs(counts, **kw)
        if tie_free(loss, preds, batch):
            return preds, batch
    raise AssertionError("no tie-free inputs in 50 draws")


def run(criterion, preds, batch, upstream):
    leaves = {k: preds[k].detach().clone().requires_grad_() for k in ("boxes", "scores", "kpts")}
    loss, items = criterion({**leaves, "feats": preds["feats"]}, dict(batch))
    (loss * upstream).sum().backward()
    grads = [leaves[k].grad for k in ("boxes", "scores", "kpts")]
    return loss.detach(), torch.stack(list(items.values())), grads


def assert_matches(got, want):
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    for g, w in zip(got[2], want[2]):
        # grads: fp32 tolerance relative to the tensor's largest grad
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item() + 1e-12)


CASES = {"two-images": [3, 5], "an-image-without-labels": [4, 0, 2], "no-labels": [0, 0],
         "crowded-image": [16, 1]}


@pytest.mark.parametrize("counts", list(CASES.values()), ids=list(CASES))
def test_matches_v8_pose_loss(counts, path, model):
    fused = FusedPoseLoss(model)
    preds, batch = draw(fused, counts)
    upstream = torch.rand(5, device=DEVICE) + 0.5
    want = run(ultralytics_loss.v8PoseLoss(model), preds, batch, upstream)
    got = run(fused, preds, add_padded_targets(dict(batch)), upstream)
    assert_matches(got, want)
    assert list(fused(preds, batch)[1]) == ["box_loss", "pose_loss", "kobj_loss", "cls_loss", "dfl_loss"]
    if sum(counts) == 0:
        assert got[1][1] == 0 and got[1][2] == 0 and got[2][2].abs().max() == 0


def test_without_padded_labels_the_loss_pads_them_itself(path, model):
    fused = FusedPoseLoss(model)
    preds, batch = draw(fused, [2, 3])
    upstream = torch.rand(5, device=DEVICE) + 0.5
    padded = add_padded_targets(dict(batch))
    assert_matches(run(fused, preds, batch, upstream), run(fused, preds, padded, upstream))


@pytest.mark.parametrize("kpt_shape", [(17, 3), (5, 2)], ids=["coco-17", "no-visibility"])
def test_other_keypoint_shapes_match(kpt_shape):
    model = pose_model(kpt_shape)
    fused = FusedPoseLoss(model)
    preds, batch = draw(fused, [2, 4], kpt_shape=kpt_shape)
    upstream = torch.rand(5, device=DEVICE) + 0.5
    want = run(ultralytics_loss.v8PoseLoss(model), preds, batch, upstream)
    assert_matches(run(fused, preds, batch, upstream), want)
    if kpt_shape[0] == 17:
        from ultralytics.utils.metrics import OKS_SIGMA

        torch.testing.assert_close(fused.sigmas.cpu(), torch.as_tensor(OKS_SIGMA, dtype=torch.float32))


def test_model_sigmas_are_checked(model):
    model.kpt_oks_sigmas = [0.1, 0.2, -0.1, 0.3]
    try:
        with pytest.raises(ValueError, match=r"FusedPoseLoss: 'kpt_oks_sigmas' must be 4 positive values"):
            FusedPoseLoss(model)
    finally:
        del model.kpt_oks_sigmas


def test_padded_keypoints_of_another_shape_are_refused(model):
    fused = FusedPoseLoss(model)
    preds, batch = make_inputs([2, 1])
    batch = add_padded_targets(dict(batch))
    batch["padded_keypoints"] = batch["padded_keypoints"][:, :, :3]
    expected = r"FusedPoseLoss: the padded keypoints must have shape \(batch, 2, 4, 3\)"
    with pytest.raises(ValueError, match=expected):
        fused(preds, batch)


@cuda
def test_no_host_sync_with_padded_labels(model):
    fused = FusedPoseLoss(model)
    preds, batch = draw(fused, [3, 0, 5])
    batch = add_padded_targets({k: v.cpu() for k, v in batch.items()})
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    leaves = {k: preds[k].detach().clone().requires_grad_() for k in ("boxes", "scores", "kpts")}
    fused({**leaves, "feats": preds["feats"]}, batch)  # warm: kernels compiled, anchors cached
    torch.cuda.synchronize()
    with no_host_sync():
        loss, _ = fused({**leaves, "feats": preds["feats"]}, batch)
        loss.sum().backward()
