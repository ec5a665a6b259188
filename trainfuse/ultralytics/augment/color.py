"""OpenCV's 8-bit BGR/HSV conversions in torch, for the augmentation kernel's reference
(:func:`~trainfuse.ultralytics.augment.kernel.augment_images_reference`), and ``RandomHSV``'s
lookup tables.

The forward conversion is OpenCV's integer arithmetic (12-bit reciprocal tables), so hue,
saturation and value match ``cv2.cvtColor(img, COLOR_BGR2HSV)`` exactly; the way back is its float
formula (sector of the hue, ``v * (1 - s * f)``), rounded half to even as OpenCV's scalar path
rounds, or down where OpenCV 5's vectorized path covers the columns (:func:`opencv_vector_block`).
"""

from __future__ import annotations

import torch

_SHIFT = 12


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(256, dtype=torch.float64)
    sdiv = torch.where(i > 0, torch.round((255 << _SHIFT) / i.clamp(min=1)), torch.zeros_like(i))
    hdiv = torch.where(i > 0, torch.round((180 << _SHIFT) / (6 * i.clamp(min=1))), torch.zeros_like(i))
    return sdiv.to(device, torch.int64), hdiv.to(device, torch.int64)


def bgr_to_hsv(images: torch.Tensor) -> torch.Tensor:
    """uint8 BGR (N, 3, H, W) to OpenCV's 8-bit HSV, exactly (``COLOR_BGR2HSV``)."""
    b, g, r = images.to(torch.int64).unbind(1)
    v = torch.maximum(torch.maximum(b, g), r)
    diff = v - torch.minimum(torch.minimum(b, g), r)
    sdiv, hdiv = _tables(images.device)
    half = 1 << (_SHIFT - 1)
    s = torch.div(diff * sdiv[v] + half, 1 << _SHIFT, rounding_mode="floor")
    h = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = torch.div(h * hdiv[diff] + half, 1 << _SHIFT, rounding_mode="floor")
    h = torch.where(h < 0, h + 180, h)
    return torch.stack((h, s, v), 1).to(torch.uint8)


# which of (v, v(1-s), v(1-s f), v(1-s(1-f))) each of b, g, r takes, per hue sector (OpenCV's table)
_SECTORS = torch.tensor([[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0]])


def hsv_to_bgr(hsv: torch.Tensor, vector_block: int = 0) -> torch.Tensor:
    """OpenCV's 8-bit HSV (N, 3, H, W) back to uint8 BGR (``COLOR_HSV2BGR``'s formula), rounded
    half to even, or down in each row's first ``W - W % vector_block`` columns where
    ``vector_block`` > 0 (OpenCV 5's vectorized path: :func:`opencv_vector_block`)."""
    h, s, v = hsv.float().unbind(1)
    s, v = s * (1 / 255), v * (1 / 255)
    h = torch.remainder(h * (6 / 180), 6)
    sector = torch.floor(h)
    f = h - sector
    sector = sector.long().clamp(0, 5)
    tab = torch.stack((v, v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))), 1)  # (N, 4, H, W)
    pick = _SECTORS.to(hsv.device)[sector].permute(0, 3, 1, 2)  # (N, 3, H, W)
    bgr = torch.gather(tab, 1, pick)
    tab_bgr = bgr = torch.where((s == 0).unsqueeze(1), v.unsqueeze(1).expand_as(bgr), bgr)
    bgr = torch.round(bgr * 255)  # half to even, as cvRound
    if vector_block > 0:
        width = hsv.shape[-1]
        down = torch.arange(width, device=hsv.device) < width - width % vector_block
        bgr = torch.where(down, torch.floor(tab_bgr * 255), bgr)
    return bgr.clamp_(0, 255).to(torch.uint8)


def opencv_vector_block() -> int:
    """How many columns at a time the installed OpenCV's vectorized ``COLOR_HSV2BGR`` converts,
    rounding down (OpenCV 5: 32 or 64, by the host's SIMD width; the last ``W % block`` columns of a
    row are rounded half to even by its scalar path), or 0 where it rounds like the scalar path:
    one conversion of a 127-pixel row of HSV (0, 1, 1), 0.996 in blue before rounding."""
    import cv2
    import numpy as np

    width = 127
    row = np.tile(np.array([[[0, 1, 1]]], dtype=np.uint8), (1, width, 1))
    rounded_up = np.nonzero(cv2.cvtColor(row, cv2.COLOR_HSV2BGR)[0, :, 0])[0]
    tail = width - (int(rounded_up[0]) if len(rounded_up) else width)  # width % block
    if tail == width:
        return 0
    return next(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if width % b == tail)


def hsv_luts(gains: torch.Tensor) -> torch.Tensor:
    """(N, 3, 256) uint8 lookup tables from gains (N, 3), as ``RandomHSV`` builds them."""
    x = torch.arange(256, dtype=torch.float64, device=gains.device)
    r = gains.to(torch.float64)
    hue = torch.remainder(x + r[:, :1] * 180, 180)
    sat = (x * (r[:, 1:2] + 1)).clamp(0, 255)
    val = (x * (r[:, 2:3] + 1)).clamp(0, 255)
    sat[:, 0] = 0  # ultralytics keeps pure white white
    return torch.stack((hue, sat, val), 1).to(torch.uint8)  # truncation, as NumPy's astype


__all__ = ["bgr_to_hsv", "hsv_luts", "hsv_to_bgr", "opencv_vector_block"]
