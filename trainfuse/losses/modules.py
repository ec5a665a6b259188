"""``nn.Module`` wrappers of the fused losses (the kernels live in iou.py and bce.py)."""

from __future__ import annotations

import torch
from torch import nn

from trainfuse.losses.bce import bce_with_logits
from trainfuse.losses.iou import bbox_iou, iou_loss


class BCEWithLogitsLoss(nn.BCEWithLogitsLoss):
    """``nn.BCEWithLogitsLoss`` on the fused kernels: same constructor, same ``weight`` and
    ``pos_weight`` buffers (so the same state_dict), same results."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return bce_with_logits(input, target, self.weight, pos_weight=self.pos_weight,
                               reduction=self.reduction)


class BboxIoU(nn.Module):
    """:func:`trainfuse.losses.bbox_iou` as a module: ``BboxIoU(CIoU=True)(box1, box2)``."""

    def __init__(self, xywh: bool = True, GIoU: bool = False, DIoU: bool = False, CIoU: bool = False,
                 eps: float = 1e-7) -> None:
        super().__init__()
        self.xywh, self.GIoU, self.DIoU, self.CIoU, self.eps = xywh, GIoU, DIoU, CIoU, eps

    def forward(self, box1: torch.Tensor, box2: torch.Tensor) -> torch.Tensor:
        return bbox_iou(box1, box2, self.xywh, self.GIoU, self.DIoU, self.CIoU, self.eps)

    def extra_repr(self) -> str:
        kind = "CIoU" if self.CIoU else "DIoU" if self.DIoU else "GIoU" if self.GIoU else "IoU"
        return f"{kind}, xywh={self.xywh}, eps={self.eps}"


class IoULoss(nn.Module):
    """:func:`trainfuse.losses.iou_loss` as a module: ``reduce(weight * (1 - IoU))``."""

    def __init__(self, kind: str = "ciou", xywh: bool = False, reduction: str = "sum",
                 eps: float = 1e-7) -> None:
        super().__init__()
        self.kind, self.xywh, self.reduction, self.eps = kind, xywh, reduction, eps

    def forward(self, pred: torch.Tensor, target: torch.Tensor,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        return iou_loss(pred, target, weight, self.kind, self.xywh, self.reduction, self.eps)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, xywh={self.xywh}, reduction={self.reduction!r}, eps={self.eps}"


__all__ = ["BCEWithLogitsLoss", "BboxIoU", "IoULoss"]
