"""The IoU family and the box loss in torch operations, in ultralytics' order: the path CPU
tensors take (and float64 where the kernels are not asked for), and the tests' reference."""

from __future__ import annotations

import math

import torch


def weight_view(weight: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """``weight`` as a tensor of shape ``rows + (1,)``: it broadcasts to the IoU's shape, or it
    has the boxes' leading shape (one weight per box)."""
    if weight.shape == rows + (1,):
        return weight
    if weight.shape == rows:
        return weight.unsqueeze(-1)
    try:
        if tuple(torch.broadcast_shapes(weight.shape, rows + (1,))) == rows + (1,):
            return weight.expand(rows + (1,))
    except RuntimeError:
        pass
    raise ValueError(f"iou_loss: weight of shape {tuple(weight.shape)} must broadcast to the IoU's "
                     f"shape {rows + (1,)} or equal the boxes' leading shape {rows}")


def bbox_iou_reference(box1: torch.Tensor, box2: torch.Tensor, xywh: bool = True, GIoU: bool = False,
                       DIoU: bool = False, CIoU: bool = False, eps: float = 1e-7) -> torch.Tensor:
    """The formula in torch operations, in ultralytics' order (the CPU path and the tests'
    reference)."""
    def corners(box):
        a, b, c, d = box.unbind(-1)
        a, b, c, d = (t.unsqueeze(-1) for t in (a, b, c, d))
        if xywh:
            return a - c / 2, b - d / 2, a + c / 2, b + d / 2, c, d
        return a, b, c, d, c - a, d - b + eps

    x1, y1, x2, y2, w1, h1 = corners(box1)
    X1, Y1, X2, Y2, w2, h2 = corners(box2)
    inter = (x2.minimum(X2) - x1.maximum(X1)).clamp(0) * (y2.minimum(Y2) - y1.maximum(Y1)).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if not (GIoU or DIoU or CIoU):
        return iou
    cw = x2.maximum(X2) - x1.minimum(X1)
    ch = y2.maximum(Y2) - y1.minimum(Y1)
    if not (DIoU or CIoU):
        c_area = cw * ch + eps
        return iou - (c_area - union) / c_area
    c2 = cw.pow(2) + ch.pow(2) + eps
    rho2 = ((X1 + X2 - x1 - x2).pow(2) + (Y1 + Y2 - y1 - y2).pow(2)) / 4
    if not CIoU:
        return iou - rho2 / c2
    v = (4 / math.pi**2) * ((w2 / h2).atan() - (w1 / h1).atan()).pow(2)
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return iou - (rho2 / c2 + v * alpha)


def flags(kind: str) -> dict[str, bool]:
    return {"GIoU": kind == "giou", "DIoU": kind == "diou", "CIoU": kind == "ciou"}


def iou_loss_reference(pred, target, weight=None, kind="ciou", xywh=False, reduction="sum",
                       eps=1e-7) -> torch.Tensor:
    loss = 1 - bbox_iou_reference(pred, target, xywh, eps=eps, **flags(kind))
    if weight is not None:
        loss = loss * weight_view(weight, loss.shape[:-1])
    return loss if reduction == "none" else loss.sum() if reduction == "sum" else loss.mean()


__all__ = ["bbox_iou_reference", "flags", "iou_loss_reference", "weight_view"]
