"""The batched matching of detections to labels against ultralytics' ``match_predictions`` (its
greedy branch) and the validator's ``_process_batch``, exactly: IoUs drawn from a few values so
that labels tie (the first one wins) and several detections compete for one label, labels of
other classes, images without labels or without detections, padding labels that look like
matches; the kernel through the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import cuda, no_host_sync
from trainfuse.losses.detection.targets import pad_targets
from trainfuse.ultralytics.validate.matching import match_detections, true_positives

pytest.importorskip("ultralytics")
from ultralytics.models.yolo.detect import DetectionValidator  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
THRESHOLDS = torch.linspace(0.5, 0.95, 10)
# IoUs on and around the thresholds, repeated: ties between labels and at a threshold
LEVELS = torch.tensor([0.0, 0.3, 0.5, 0.55, 0.7, 0.75, 0.95, 1.0])


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return DetectionValidator(save_dir=tmp_path_factory.mktemp("val"))


def expected_tp(stock, iou, label_cls, pred_cls, nlabels, count):
    """ultralytics' tp, image by image on the CPU, padded with False."""
    B, M, D = iou.shape
    out = torch.zeros(B, D, 10, dtype=torch.bool)
    for b in range(B):
        m, n = int(nlabels[b]), int(count[b])
        if m and n:
            out[b, :n] = stock.match_predictions(pred_cls[b, :n], label_cls[b, :m], iou[b, :m, :n])
    return out


def test_equals_match_predictions(path, stock):
    B, M, D, nc = 6, 7, 23, 3
    iou = torch.where(torch.rand(B, M, D) < 0.6, LEVELS[torch.randint(0, len(LEVELS), (B, M, D))],
                      torch.rand(B, M, D))
    label_cls = torch.randint(0, nc, (B, M)).float()
    pred_cls = torch.randint(0, nc, (B, D)).float()
    nlabels = torch.tensor([M, 0, 3, 5, 1, M])
    count = torch.tensor([D, 5, 0, 17, D, 1])
    masked = iou * (label_cls[:, :, None] == pred_cls[:, None, :])
    # padding labels' rows hold matches the count must hide
    padding = torch.arange(M)[None, :, None] >= nlabels[:, None, None]
    masked = torch.where(padding, 1.0, masked)
    tp = match_detections(masked.transpose(1, 2).contiguous().to(DEVICE), nlabels.to(DEVICE),
                          count.to(DEVICE), THRESHOLDS.to(DEVICE))
    want = expected_tp(stock, iou, label_cls, pred_cls, nlabels, count)
    assert tp.dtype == torch.bool and tp.shape == (B, D, 10)
    assert torch.equal(tp.cpu(), want)
    assert want[:, :, 0].sum() > want[:, :, -1].sum() > 0  # matches at some thresholds, not all


def test_no_match_across_classes(path):
    iou = torch.ones(2, 9, 4, device=DEVICE)  # every detection on every label, but of another class
    label_cls = torch.zeros(2, 4, device=DEVICE)
    pred_cls = torch.ones(2, 9, device=DEVICE)
    masked = (iou * (label_cls[:, None, :] == pred_cls[:, :, None])).contiguous()
    tp = match_detections(masked, torch.tensor([4, 2], device=DEVICE), torch.tensor([9, 9], device=DEVICE),
                          THRESHOLDS.to(DEVICE))
    assert not tp.any()


@pytest.mark.parametrize("imgsz", [(64, 64), (64, 96)])
def test_true_positives_equal_process_batch(path, stock, imgsz):
    """Detections near the labels (jittered copies, some relabelled) against stock's per-image
    ``_prepare_batch`` and ``_process_batch``."""
    counts, nc, D = [4, 0, 6, 2], 3, 12
    B, n = len(counts), sum(counts)
    batch_idx = torch.cat([torch.full((c,), float(i)) for i, c in enumerate(counts)])
    xy, wh = torch.rand(n, 2) * 0.6 + 0.2, torch.rand(n, 2) * 0.3 + 0.1
    batch = {"batch_idx": batch_idx, "cls": torch.randint(0, nc, (n, 1)).float(),
             "bboxes": torch.cat([xy, wh], 1), "img": torch.zeros(B, 3, *imgsz), "ori_shape": [imgsz] * B,
             "ratio_pad": [None] * B, "im_file": [f"{i}.jpg" for i in range(B)]}
    boxes, cls = torch.zeros(B, D, 4), torch.zeros(B, D)
    count = torch.tensor([D, 5, D, 0])
    scale = torch.tensor([imgsz[1], imgsz[0]] * 2)
    for b in range(B):
        pbatch = stock._prepare_batch(b, batch)
        k = len(pbatch["cls"])
        pick = torch.randint(0, max(k, 1), (D,))
        base = pbatch["bboxes"][pick] if k else torch.rand(D, 4) * scale
        boxes[b] = base + torch.randn(D, 4) * 3
        other = torch.randint(0, nc, (D,)).float()
        cls[b] = torch.where(torch.rand(D) < 0.8, pbatch["cls"][pick] if k else 0.0, other)
    padded = pad_targets(batch_idx, batch["cls"], batch["bboxes"], B, 8)
    tp = true_positives(boxes.to(DEVICE), cls.to(DEVICE), count.to(DEVICE), padded.to(DEVICE),
                        torch.tensor(counts, device=DEVICE), imgsz, THRESHOLDS.to(DEVICE)).cpu()
    for b in range(B):
        n = int(count[b])
        pred = {"bboxes": boxes[b, :n], "cls": cls[b, :n], "conf": torch.ones(n)}
        want = stock._process_batch(pred, stock._prepare_batch(b, batch))["tp"]
        assert torch.equal(tp[b, :n], torch.from_numpy(want)), b
        assert not tp[b, n:].any()
    assert tp[:, :, 0].any()


@cuda
def test_the_kernel_path_does_not_sync(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    iou = torch.rand(8, 300, 64, device="cuda")
    args = (torch.full((8,), 50, device="cuda"), torch.full((8,), 300, device="cuda"), THRESHOLDS.cuda())
    match_detections(iou, *args)  # compiles
    with no_host_sync():
        tp = match_detections(iou, *args)
    assert tp[:, :, 0].any()
