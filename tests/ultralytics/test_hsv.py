"""OpenCV's 8-bit HSV conversions in torch (the augmentation kernel's reference): BGR to HSV
exactly as OpenCV, HSV to BGR as its scalar path (half to even) and as OpenCV 5's vectorized path
(rounded down in whole blocks of a row), and which of the two the installed OpenCV runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

cv2 = pytest.importorskip("cv2")

from trainfuse.ultralytics.augment.color import bgr_to_hsv, hsv_to_bgr, opencv_vector_block  # noqa: E402


def _chw(img: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(img).permute(2, 0, 1)[None].contiguous()


def _hwc(t: torch.Tensor) -> np.ndarray:
    return t[0].permute(1, 2, 0).numpy().astype(int)


def test_bgr_to_hsv_is_opencvs_exactly():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    img[0, :6] = [[0, 0, 0], [255, 255, 255], [7, 7, 7], [255, 0, 0], [0, 255, 0], [0, 0, 255]]
    assert np.array_equal(_hwc(bgr_to_hsv(_chw(img))), cv2.cvtColor(img, cv2.COLOR_BGR2HSV))


@pytest.mark.parametrize("width", [1, 40, 96, 127])
def test_hsv_to_bgr_rounds_as_the_installed_opencv(width):
    rng = np.random.default_rng(width)
    hsv = np.stack([rng.integers(0, 180, (16, width)), rng.integers(0, 256, (16, width)),
                    rng.integers(0, 256, (16, width))], -1).astype(np.uint8)
    want = cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR).astype(int)
    ours = _hwc(hsv_to_bgr(_chw(hsv), vector_block=opencv_vector_block()))
    diff = np.abs(ours - want)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999, (diff.max(), (diff == 0).mean())
    # the other rounding would be off by a level in about a third of the values (where a row holds
    # a vector block at all: the host's SIMD width sets it, 32 or 64 columns with OpenCV 5)
    block = opencv_vector_block()
    other = _hwc(hsv_to_bgr(_chw(hsv), vector_block=0 if block else 1))
    if not block or width >= block:
        assert (other != want).mean() > 0.1


def test_the_vector_block_is_a_power_of_two_or_none():
    block = opencv_vector_block()
    assert block == 0 or (block & (block - 1) == 0 and 1 <= block <= 128)
