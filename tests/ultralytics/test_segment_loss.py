"""FusedSegmentationLoss against ultralytics' v8SegmentationLoss on a real YOLOv8n SegmentationModel:
loss, the five items and the grads of the box, score, mask-coefficient and prototype predictions,
on random predictions, labels and masks (images without labels, a batch without any, a crowded
image, overlapping index maps (``overlap_mask``, the default) and one mask per label, masks larger
than the prototypes, the fallback without padded labels), through the detection kernels (the
interpreter on CPU) and the dense torch path; and no host sync on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import cuda, no_host_sync
from tests.ultralytics.test_loss import tie_free
from trainfuse.ultralytics import add_padded_targets
from trainfuse.ultralytics.segment_loss import FusedSegmentationLoss

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 2
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KEYS = ("boxes", "scores", "mask_coefficient", "proto")


@pytest.fixture(scope="module")
def model():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import SegmentationModel

    m = SegmentationModel("yolov8n-seg.yaml", nc=NC, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


def make_inputs(counts, overlap=True, mask_size=16, imgsz=(64, 64), aligned=False):
    """Predictions and a segmentation batch: ``counts[i]`` labels in image i, each label's mask a
    random blob inside its box (index maps where ``overlap``, later labels on top); ``aligned``:
    box edges on the mask's pixel edges, where the crop's bounds decide."""
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    A = sum(h * w for h, w in sizes)
    slope = torch.cat([torch.full((h * w,), k) for (h, w), k in zip(sizes, (0.4, 0.8, 1.5))])
    bias = -slope * torch.arange(16.0).repeat(4).view(1, 64, 1)
    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.4 + 0.15
    if aligned:  # centres on pixel edges, even widths: every edge on one (exact in float32)
        xy, wh = (xy * 16).round() / 16, (wh * 8).round() / 8
    grid = (torch.arange(mask_size) + 0.5) / mask_size
    inside = ((grid.view(1, 1, -1) - xy[:, None, :1]).abs() < wh[:, None, :1] / 2) \
        & ((grid.view(1, -1, 1) - xy[:, None, 1:2]).abs() < wh[:, None, 1:2] / 2)
    blob = inside & (torch.rand(n, mask_size, mask_size) < 0.8)
    if overlap:
        masks = torch.zeros(B, mask_size, mask_size)
        for j in range(n):
            image = int(idx[j])
            within = int((idx[:j] == image).sum())
            masks[image][blob[j]] = within + 1
    else:
        masks = blob.float()
    batch = {"img": torch.zeros(B, 3, *imgsz), "batch_idx": idx, "cls": torch.randint(0, NC, (n, 1)).float(),
             "bboxes": torch.cat([xy, wh], 1), "masks": masks}
    preds = {"boxes": 0.5 * torch.randn(B, 64, A) + bias, "scores": torch.randn(B, NC, A) - 1,
             "mask_coefficient": torch.randn(B, 32, A), "proto": torch.randn(B, 32, 16, 16),
             "feats": [torch.zeros(B, 1, h, w) for h, w in sizes]}
    return ({k: v.to(DEVICE) if torch.is_tensor(v) else [f.to(DEVICE) for f in v] for k, v in preds.items()},
            {k: v.to(DEVICE) for k, v in batch.items()})


def draw(loss, counts, **kw):
    for _ in range(50):
        preds, batch = make_inputs(counts, **kw)
        if tie_free(loss, preds, batch):
            return preds, batch
    raise AssertionError("no tie-free inputs in 50 draws")


def run(criterion, preds, batch, upstream):
    leaves = {k: preds[k].detach().clone().requires_grad_() for k in KEYS}
    loss, items = criterion({**leaves, "feats": preds["feats"]}, dict(batch))
    (loss * upstream).sum().backward()
    return loss.detach(), torch.stack(list(items.values())), [leaves[k].grad for k in KEYS]


def assert_matches(got, want):
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    for g, w in zip(got[2], want[2]):
        # grads: fp32 tolerance relative to the tensor's largest grad
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item() + 1e-12)


def with_overlap(model, overlap: bool):
    model.args.overlap_mask = overlap
    return model


CASES = {"two-images": [3, 5], "an-image-without-labels": [4, 0, 2], "no-labels": [0, 0],
         "crowded-image": [16, 1]}


@pytest.mark.parametrize("overlap", [True, False], ids=["index-maps", "a-mask-per-label"])
@pytest.mark.parametrize("counts", list(CASES.values()), ids=list(CASES))
def test_matches_v8_segmentation_loss(counts, overlap, path, model):
    with_overlap(model, overlap)
    try:
        fused = FusedSegmentationLoss(model)
        preds, batch = draw(fused, counts, overlap=overlap)
        upstream = torch.rand(5, device=DEVICE) + 0.5
        want = run(ultralytics_loss.v8SegmentationLoss(model), preds, batch, upstream)
        got = run(fused, preds, add_padded_targets(dict(batch)), upstream)
    finally:
        with_overlap(model, True)
    assert_matches(got, want)
    names = ["box_loss", "seg_loss", "cls_loss", "dfl_loss", "sem_loss"]
    assert list(fused(preds, batch)[1]) == names
    if sum(counts) == 0:
        assert got[1][1] == 0 and got[2][2].abs().max() == 0 and got[2][3].abs().max() == 0


@pytest.mark.parametrize("aligned", [False, True], ids=["boxes-anywhere", "box-edges-on-pixel-edges"])
@pytest.mark.parametrize("overlap", [True, False], ids=["index-maps", "a-mask-per-label"])
def test_masks_larger_than_the_prototypes_and_no_padded_labels_match(overlap, aligned, model):
    with_overlap(model, overlap)
    try:
        fused = FusedSegmentationLoss(model)
        preds, batch = draw(fused, [2, 3], overlap=overlap, mask_size=32, aligned=aligned)
        upstream = torch.rand(5, device=DEVICE) + 0.5
        want = run(ultralytics_loss.v8SegmentationLoss(model), preds, batch, upstream)
        got = run(fused, preds, batch, upstream)
    finally:
        with_overlap(model, True)
    assert_matches(got, want)


@cuda
def test_no_host_sync_with_padded_labels(model):
    fused = FusedSegmentationLoss(model)
    preds, batch = draw(fused, [3, 0, 5])
    batch = add_padded_targets({k: v.cpu() for k, v in batch.items()})
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    leaves = {k: preds[k].detach().clone().requires_grad_() for k in KEYS}
    fused({**leaves, "feats": preds["feats"]}, batch)  # warm: kernels compiled, anchors cached
    torch.cuda.synchronize()
    with no_host_sync():
        loss, _ = fused({**leaves, "feats": preds["feats"]}, batch)
        loss.sum().backward()
