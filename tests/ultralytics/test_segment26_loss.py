"""FusedE2ELoss over FusedSegment26Loss against ultralytics' E2ELoss over SegmentLoss26 on a real
YOLO26n SegmentationModel (an end-to-end head without DFL, a semantic branch beside the
prototypes): the loss, its five items and the grads of every prediction of both branches, on
random predictions and labels (an image without labels, a batch without any, a crowded image),
through the detection kernels (the interpreter on CPU) and the dense torch path."""

from __future__ import annotations

import pytest
import torch

from trainfuse.ultralytics import add_padded_targets
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss
from trainfuse.ultralytics.segment26_loss import FusedSegment26Loss

ultralytics_loss = pytest.importorskip("ultralytics.utils.loss")
NC = 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ["box_loss", "seg_loss", "cls_loss", "l1_loss", "sem_loss"]


@pytest.fixture(scope="module")
def model():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import SegmentationModel

    m = SegmentationModel("yolo26n-seg.yaml", nc=NC, verbose=False).to(DEVICE)
    m.args = get_cfg()
    return m


def make_inputs(counts, mask_size=16, imgsz=(64, 64)):
    """Both branches' predictions and a segmentation batch with index maps (overlap_mask, later
    labels on top) and the semantic class map; boxes from 3 to 40 pixels."""
    B = len(counts)
    sizes = [(imgsz[0] // s, imgsz[1] // s) for s in (8, 16, 32)]
    A = sum(h * w for h, w in sizes)
    n = sum(counts)
    idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)]) if n else torch.zeros(0)
    cls = torch.randint(0, NC, (n, 1)).float()
    xy = torch.rand(n, 2) * 0.5 + 0.25
    wh = torch.rand(n, 2) * 0.6 + 0.05
    grid = (torch.arange(mask_size) + 0.5) / mask_size
    inside = ((grid.view(1, 1, -1) - xy[:, None, :1]).abs() < wh[:, None, :1] / 2) \
        & ((grid.view(1, -1, 1) - xy[:, None, 1:2]).abs() < wh[:, None, 1:2] / 2)
    blob = inside & (torch.rand(n, mask_size, mask_size) < 0.8)
    masks = torch.zeros(B, mask_size, mask_size)
    semantic = torch.zeros(B, mask_size, mask_size)
    for j in range(n):
        image = int(idx[j])
        masks[image][blob[j]] = int((idx[:j] == image).sum()) + 1
        semantic[image][blob[j]] = cls[j, 0]
    batch = {"img": torch.zeros(B, 3, *imgsz), "batch_idx": idx, "cls": cls, "bboxes": torch.cat([xy, wh], 1),
             "masks": masks, "sem_masks": semantic}

    def branch():
        return {"boxes": torch.rand(B, 4, A) * 2 + 0.2, "scores": torch.randn(B, NC, A) - 1,
                "mask_coefficient": torch.randn(B, 32, A),
                "proto": (torch.randn(B, 32, mask_size, mask_size),
                          torch.randn(B, NC, mask_size // 2, mask_size // 2)),
                "feats": [torch.zeros(B, 1, h, w) for h, w in sizes]}

    def to(v):
        return v.to(DEVICE) if torch.is_tensor(v) else type(v)(f.to(DEVICE) for f in v)

    preds = {name: {k: to(v) for k, v in branch().items()} for name in ("one2many", "one2one")}
    return preds, {k: v.to(DEVICE) for k, v in batch.items()}


def run(criterion, preds, batch, upstream):
    leaves, given = [], {}
    for name, p in preds.items():
        mine = {k: p[k].detach().clone().requires_grad_() for k in ("boxes", "scores", "mask_coefficient")}
        proto = tuple(t.detach().clone().requires_grad_() for t in p["proto"])
        leaves += [*mine.values(), *proto]
        given[name] = {**mine, "proto": proto, "feats": p["feats"]}
    loss, items = criterion(given, dict(batch))
    (loss * upstream).sum().backward()
    return loss.detach(), torch.stack(list(items.values())), [t.grad for t in leaves], list(items)


def assert_matches(got, want):
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item() + 1e-12)
    assert got[3] == want[3]


CASES = {"two-images": [3, 5], "an-image-without-labels": [4, 0, 2], "no-labels": [0, 0],
         "crowded-image": [12, 1]}


@pytest.mark.parametrize("counts", list(CASES.values()), ids=list(CASES))
def test_matches_e2e_segment_loss_26(counts, path, model):
    fused = FusedE2ELoss(model, FusedSegment26Loss)
    preds, batch = make_inputs(counts)
    upstream = torch.rand(5, device=DEVICE) + 0.5
    want = run(ultralytics_loss.E2ELoss(model, ultralytics_loss.SegmentLoss26), preds, batch, upstream)
    got = run(fused, preds, add_padded_targets(dict(batch)), upstream)
    assert_matches(got, want)
    assert got[3] == NAMES
    if sum(counts) == 0:
        assert got[1][1] == 0 and got[1][4] == 0


def test_the_graphs_take_the_index_maps_and_the_semantic_masks(model):
    assert FusedE2ELoss(model, FusedSegment26Loss).graph_keys == ("padded_targets", "masks", "sem_masks")
