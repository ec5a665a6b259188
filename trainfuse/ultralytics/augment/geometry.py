"""``RandomPerspective``'s warp of a batch of images and of their boxes, its box filter, and
``RandomFlip``.

The warp samples each output pixel's source point (the inverse of the matrix applied to the pixel's
centre) bilinearly, with ultralytics' grey (114) outside the image: what ``cv2.warpAffine`` /
``cv2.warpPerspective`` compute. OpenCV rounds the source coordinates to 1/32 pixel and the
weights to 11 bits for uint8 images; here both are float32, so a pixel may differ from OpenCV's by
a level or two where neighbours differ a lot (the tests bound it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainfuse.ultralytics.augment.params import AffineParams

BORDER = 114  # ultralytics' fill outside the warped image


def warp_images(images: torch.Tensor, params: AffineParams, border: int = BORDER) -> torch.Tensor:
    """Warp uint8 ``images`` (N, C, H, W) by ``params.matrix`` to ``params.size`` (W, H): uint8
    (N, C, h, w), as ``cv2.warpAffine(img, M[:2], size, borderValue=border)`` per image (or
    ``warpPerspective`` with ``params.perspective``)."""
    if images.dim() != 4 or images.dtype != torch.uint8:
        raise ValueError(f"warp_images: images must be uint8 (N, C, H, W), got {images.dtype} "
                         f"{tuple(images.shape)}")
    n, _, h_in, w_in = images.shape
    if params.matrix.shape != (n, 3, 3):
        raise ValueError(f"warp_images: params hold {params.matrix.shape[0]} matrices for {n} images")
    w, h = params.size
    device = images.device
    inverse = torch.linalg.inv(params.matrix).to(device)  # float64: output pixel -> input point
    ys, xs = torch.meshgrid(torch.arange(h, device=device, dtype=torch.float64),
                            torch.arange(w, device=device, dtype=torch.float64), indexing="ij")
    pixels = torch.stack((xs, ys, torch.ones_like(xs)), -1).view(1, h * w, 3)
    src = pixels @ inverse.transpose(1, 2)  # (N, h*w, 3)
    xy = src[..., :2] / src[..., 2:3] if params.perspective else src[..., :2]
    # align_corners=True: -1 and 1 are the centres of the first and last input pixels
    scale = torch.tensor([2 / max(w_in - 1, 1), 2 / max(h_in - 1, 1)], device=device, dtype=torch.float64)
    grid = (xy * scale - 1).view(n, h, w, 2).float()
    shifted = images.float() - border  # zeros outside == the border value once shifted back
    out = F.grid_sample(shifted, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    return (out + border).round_().clamp_(0, 255).to(torch.uint8)


def warp_boxes(boxes: torch.Tensor, image_index: torch.Tensor, params: AffineParams) -> torch.Tensor:
    """Boxes (K, 4) xyxy in input pixels of images ``image_index`` (K,) after the warp: the
    axis-aligned box around the four warped corners, clipped to the output size (K, 4), as
    ``RandomPerspective.apply_bboxes`` then ``Instances.clip``."""
    if boxes.numel() == 0:
        return boxes.reshape(0, 4).clone()
    matrix = params.matrix.to(boxes.device)[image_index]  # (K, 3, 3)
    x1, y1, x2, y2 = boxes.double().unbind(1)
    corners = torch.stack((torch.stack((x1, y1), 1), torch.stack((x2, y2), 1), torch.stack((x1, y2), 1),
                           torch.stack((x2, y1), 1)), 1)  # (K, 4, 2)
    xy = torch.cat((corners, torch.ones_like(corners[..., :1])), -1) @ matrix.transpose(1, 2)
    xy = xy[..., :2] / xy[..., 2:3] if params.perspective else xy[..., :2]
    w, h = params.size
    out = torch.stack((xy[..., 0].amin(1).clamp(0, w), xy[..., 1].amin(1).clamp(0, h),
                       xy[..., 0].amax(1).clamp(0, w), xy[..., 1].amax(1).clamp(0, h)), 1)
    return out.to(boxes.dtype)


def box_candidates(before: torch.Tensor, after: torch.Tensor, scale: torch.Tensor, wh_thr: float = 2,
                   ar_thr: float = 100, area_thr: float = 0.1, eps: float = 1e-16) -> torch.Tensor:
    """Which warped boxes ultralytics keeps (K,) bool: wider and taller than ``wh_thr`` pixels, an
    aspect ratio under ``ar_thr``, and more than ``area_thr`` of the area the box had, scaled by
    its image's ``scale`` (K,), before the warp (``RandomPerspective.box_candidates``)."""
    w1 = (before[:, 2] - before[:, 0]).double() * scale
    h1 = (before[:, 3] - before[:, 1]).double() * scale
    w2 = (after[:, 2] - after[:, 0]).double()
    h2 = (after[:, 3] - after[:, 1]).double()
    ar = torch.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


def flip(images: torch.Tensor, boxes: torch.Tensor, image_index: torch.Tensor, flipped: torch.Tensor,
         horizontal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``RandomFlip`` on the images ``flipped`` (N,) bool selects: the images (N, C, H, W) and the
    boxes (K, 4) xyxy pixels of images ``image_index``, new tensors."""
    flipped = flipped.to(images.device)
    dim = -1 if horizontal else -2
    out = torch.where(flipped.view(-1, 1, 1, 1), images.flip(dim), images)
    size = images.shape[dim]
    moved = boxes.clone()
    which = flipped.to(boxes.device)[image_index] if boxes.numel() else flipped.new_zeros(0)
    lo, hi = (0, 2) if horizontal else (1, 3)
    moved[which, lo] = size - boxes[which, hi]
    moved[which, hi] = size - boxes[which, lo]
    return out, moved


__all__ = ["BORDER", "box_candidates", "flip", "warp_boxes", "warp_images"]
