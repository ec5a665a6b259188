"""Fused detection losses: IoU/GIoU/DIoU/CIoU (ultralytics-exact) and BCE-with-logits, each one
launch forward and one backward with the weighting and reduction inside."""

from trainfuse.losses.bce import bce_with_logits
from trainfuse.losses.iou import bbox_iou, iou_loss
from trainfuse.losses.modules import BboxIoU, BCEWithLogitsLoss, IoULoss

__all__ = ["BCEWithLogitsLoss", "BboxIoU", "IoULoss", "bbox_iou", "bce_with_logits", "iou_loss"]
