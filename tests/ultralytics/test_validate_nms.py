"""batched_nms against ultralytics' non_max_suppression (torchvision's nms, as the validator runs it),
row for row: multi-label and best-class, class-aware and agnostic, float32 and float16 predictions
(whose scores tie often: equal scores keep ultralytics' candidate order), images without
candidates, the max_det and max_nms cuts, a class filter, extra channels; the kernel through the
interpreter on CPU. The reference runs on the CPU, where torchvision sorts scores stably: the
kernel's order of equal scores is that one.

Where more candidates than max_nms pass, ultralytics cuts them with an unstable sort: those tests
draw distinct scores (``distinct``), so that the cut is one set of candidates."""

from __future__ import annotations

import math

import pytest
import torch

# ultralytics' NMS takes torchvision's nms once it is imported, as every validator has it
import torchvision  # noqa: F401

from tests._helpers import cuda, no_host_sync
from trainfuse.ultralytics.validate.nms import BatchedDetections, batched_nms, iou_threshold

non_max_suppression = pytest.importorskip("ultralytics.utils.nms").non_max_suppression
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def predictions(B: int, nc: int, A: int, dtype=torch.float32, empty=(), distinct=False, extra=0):
    """A head's output ``(B, 4 + nc + extra, A)``: boxes of 1-21 px in a 64 px field (many
    overlaps), scores cubed uniforms (a fifth below 0.01), or with ``distinct`` a permutation of
    distinct values; the images in ``empty`` score 0 everywhere."""
    p = torch.empty(B, 4 + nc + extra, A)
    p[:, :2] = torch.rand(B, 2, A) * 64
    p[:, 2:4] = torch.rand(B, 2, A) * 20 + 1
    if distinct:
        p[:, 4:4 + nc] = (torch.randperm(B * nc * A) + 1).view(B, nc, A) / (B * nc * A + 1)
    else:
        p[:, 4:4 + nc] = torch.rand(B, nc, A) ** 3
    p[:, 4 + nc:] = torch.randn(B, extra, A)
    for i in empty:
        p[i, 4:4 + nc] = 0
    return p.to(DEVICE, dtype)


def assert_as_ultralytics(det: BatchedDetections, pred: torch.Tensor, path: str, max_det: int = 300, **kw):
    # the kernel's ties are the CPU's; ultralytics' own function on the GPU sorts its own way
    ref_device = "cpu" if path == "kernels" else pred.device
    expected = non_max_suppression(pred.to(ref_device), max_det=max_det, **kw)
    assert det.rows.shape == (pred.shape[0], max_det, 6) and det.rows.dtype == torch.float32
    assert det.count.dtype == torch.int32
    assert det.count.tolist() == [len(x) for x in expected]
    for rows, n, x in zip(det.rows.cpu(), det.count.tolist(), expected):
        assert torch.equal(rows[:n], x[:, :6].cpu())
        assert not rows[n:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("multi_label", [True, False])
@pytest.mark.parametrize("agnostic", [False, True])
def test_equals_ultralytics_nms(path, dtype, multi_label, agnostic):
    pred = predictions(3, 4, 45, dtype, empty=(1,))
    det = batched_nms(pred, 0.01, 0.5, multi_label=multi_label, agnostic=agnostic)
    assert_as_ultralytics(det, pred, path, conf_thres=0.01, iou_thres=0.5, multi_label=multi_label,
                          agnostic=agnostic)
    assert det.count[1] == 0 and det.count[0] > 0


def test_one_class_and_an_odd_grid(path):
    pred = predictions(2, 1, 37)
    det = batched_nms(pred, 0.001, 0.7, multi_label=True)
    assert_as_ultralytics(det, pred, path, conf_thres=0.001, iou_thres=0.7, multi_label=True)


def test_stops_at_max_det(path):
    pred = predictions(2, 3, 40)
    det = batched_nms(pred, 0.001, 0.7, multi_label=True, max_det=5)
    assert det.count.tolist() == [5, 5]
    assert_as_ultralytics(det, pred, path, max_det=5, conf_thres=0.001, iou_thres=0.7, multi_label=True)


@pytest.mark.parametrize("multi_label", [True, False])
def test_cuts_at_max_nms(path, multi_label):
    pred = predictions(2, 3, 40, distinct=True)
    det = batched_nms(pred, 0.001, 0.6, multi_label=multi_label, max_nms=17)
    assert_as_ultralytics(det, pred, path, conf_thres=0.001, iou_thres=0.6, multi_label=multi_label,
                          max_nms=17)
    assert 0 < det.count.max() <= 17


def test_class_filter_and_extra_channels(path):
    pred = predictions(2, 4, 30, extra=3)
    det = batched_nms((pred, None), 0.01, 0.5, classes=[1, 3], multi_label=True, nc=4)
    assert_as_ultralytics(det, pred, path, conf_thres=0.01, iou_thres=0.5, classes=[1, 3], multi_label=True,
                          nc=4)
    assert set(det.cls[det.conf > 0].tolist()) == {1.0, 3.0}


def test_no_candidates_anywhere(path):
    pred = predictions(2, 3, 20, empty=(0, 1))
    det = batched_nms(pred, 0.25, 0.45)
    assert det.count.tolist() == [0, 0] and not det.rows.any()
    assert det.to_list()[0].shape == (0, 6)


def test_thresholds_compare_as_torchvision_does():
    # 0.6 rounds up to float32: the CPU kernel compares with the double, the CUDA kernel with the float
    up = torch.tensor(0.6, dtype=torch.float32)
    assert float(up) > 0.6
    assert iou_threshold(0.6, torch.device("cuda")) == float(up)
    assert iou_threshold(0.6, torch.device("cpu")) == float(torch.nextafter(up, torch.tensor(-math.inf)))
    assert iou_threshold(0.7, torch.device("cpu")) == iou_threshold(0.7, torch.device("cuda")) == float(
        torch.tensor(0.7, dtype=torch.float32))
    with pytest.raises(ValueError, match="iou_thres"):
        batched_nms(torch.zeros(1, 5, 3), 0.1, 1.5)


@cuda
def test_the_kernel_path_does_not_sync(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    pred = predictions(4, 20, 300, torch.float16)  # fewer than max_nms: the cut would be unstable
    batched_nms(pred, 0.001, 0.7, multi_label=True)  # compiles
    with no_host_sync():
        det = batched_nms(pred, 0.001, 0.7, multi_label=True)
    assert_as_ultralytics(det, pred, "kernels", conf_thres=0.001, iou_thres=0.7, multi_label=True)
