"""FusedSegment26Loss: ultralytics' ``SegmentLoss26`` (YOLO26's segmentation head) without host syncs.

Same constructor and call as :class:`~trainfuse.ultralytics.segment_loss.FusedSegmentationLoss`,
the branch loss of :class:`~trainfuse.ultralytics.FusedE2ELoss` for YOLO26's end-to-end
segmentation head (``FusedE2ELoss(model, FusedSegment26Loss)``, as ultralytics builds
``E2ELoss(model, SegmentLoss26)``). What YOLO26 changes, each as ultralytics has it:

- **the assignment** (``SegTaskAlignedAssigner``): a candidate pair's overlap is the mean of its
  box IoU and its predicted mask's IoU with the label's mask, the mask IoU taken for each label's
  ``3 topk`` pairs of best box metric (``score^alpha IoU^beta``) and 0 for the others; the
  predicted mask ``coefficients . proto > 0``, cropped to the predicted box. ultralytics decodes the
  chosen anchors' masks after gathering them by boolean indexing; here each label's ``3 topk``
  anchors are taken by ``topk`` over the dense metric (fixed shapes), their masks decoded at once.
- **the semantic term** (``Segment26``'s second output): BCE-with-logits plus Dice (half each) of
  the per-class semantic logits against the one-hot of ``batch["sem_masks"]`` where a label covers
  the pixel, nearest-resized to the logits' size, times the ``box`` gain; 0 in a batch without
  foreground (ultralytics skips it there), as ``v8SegmentationLoss`` computes it for such heads.

The mask term and the rest are FusedSegmentationLoss's. With ``overlap_mask`` (ultralytics'
default) a step reads the padded labels, the index maps and the semantic masks (``graph_keys``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from trainfuse.losses.detection import PADDED_KEY
from trainfuse.losses.detection.assigner import Assignment, assignment_from_metric, decode, metric_torch
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss
from trainfuse.ultralytics.loss import Assigned
from trainfuse.ultralytics.segment_loss import FusedSegmentationLoss

SEMANTIC_KEY = "sem_masks"  # ultralytics' per-pixel class map of a YOLO26 segmentation batch


class FusedSegment26Loss(FusedSegmentationLoss):
    """Drop-in for ultralytics' ``SegmentLoss26`` (see the module docstring).

    Args:
        model: the de-paralleled ``SegmentationModel`` with a ``Segment26`` head; read as
            :class:`~trainfuse.ultralytics.segment_loss.FusedSegmentationLoss` reads it.
        tal_topk: the assigner's k.
        tal_topk2: its second k (None: ``tal_topk``).
    """

    def __init__(self, model: torch.nn.Module, tal_topk: int = 10, tal_topk2: int | None = None) -> None:
        super().__init__(model, tal_topk, tal_topk2)
        if self.overlap:
            self.graph_keys = (PADDED_KEY, "masks", SEMANTIC_KEY)

    @override
    def split_proto(self, proto: torch.Tensor | tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(proto, (tuple, list)):
            return proto[0], proto[1]
        return proto, None

    def label_masks(self, batch: dict[str, torch.Tensor], capacity: int, size: tuple[int, int],
                    device: torch.device) -> torch.Tensor:
        """Each label slot's mask ``(B, capacity, h, w)`` (bool) at the prototypes' ``size``."""
        masks = self.masks(batch, capacity, device)
        if masks.shape[-2:] != size:
            masks = F.interpolate(masks[None].float(), size, mode="nearest")[0]
        if self.overlap:  # value j + 1 marks the image's j-th label
            numbers = torch.arange(1, capacity + 1, device=device, dtype=torch.float32).view(1, -1, 1, 1)
            return masks[:, None].float() == numbers
        return masks > 0.5

    @override
    def assign(self, boxes: torch.Tensor, scores: torch.Tensor, gt: torch.Tensor, imgsz: tuple[float, float],
               anchors: torch.Tensor, strides: torch.Tensor, preds: dict[str, Any],
               batch: dict[str, torch.Tensor], *, fused: bool) -> Assignment:
        """``SegTaskAlignedAssigner``'s assignment (the module docstring), dense in torch."""
        with torch.no_grad():
            cfg = self.assign_config
            _, iou, cand = metric_torch(boxes, scores, gt, imgsz, anchors, strides, cfg)
            B, M, A = cand.shape
            proto = self.split_proto(preds["proto"])[0].detach()
            nm, mh, mw = proto.shape[1:]
            sig = scores.float().sigmoid().gather(1, gt[..., 0].long()[..., None].clamp(0).expand(B, M, A))
            dense = torch.where(cand, sig.pow(cfg.alpha) * iou.pow(cfg.beta) + cfg.eps, 0.0)
            k = min(3 * cfg.topk, A)
            top = dense.topk(k, dim=-1).indices.view(B, M * k)  # each label's k best pairs
            coef = preds["mask_coefficient"].detach().to(proto.dtype)
            chosen = coef.gather(2, top[:, None].expand(B, nm, M * k))  # (B, nm, M k)
            shown = torch.einsum("bnj,bnp->bjp", chosen, proto.flatten(2)) > 0  # (B, M k, h w)
            pd = decode(boxes, anchors) * strides[:, None] * (mh / imgsz[0])  # (B, A, 4), mask pixels
            x1, y1, x2, y2 = pd.gather(1, top[..., None].expand(B, M * k, 4)).unbind(-1)
            cols = torch.arange(mw, device=pd.device, dtype=pd.dtype)
            rows = torch.arange(mh, device=pd.device, dtype=pd.dtype)
            inside = (((cols >= x1[..., None]) & (cols < x2[..., None]))[:, :, None, :]
                      & ((rows >= y1[..., None]) & (rows < y2[..., None]))[:, :, :, None])
            shown = (shown.view(B, M * k, mh, mw) & inside).view(B, M, k, mh * mw)
            target = self.label_masks(batch, M, (mh, mw), proto.device).flatten(2)  # (B, M, h w)
            inter = (shown & target[:, :, None]).sum(-1)
            union = target.sum(-1)[..., None] + shown.sum(-1) - inter
            mask_iou = torch.zeros_like(iou).scatter_(-1, top.view(B, M, k), inter / union.clamp(min=1))
            ov = torch.where(cand, (iou + mask_iou) / 2, 0.0)
            align = torch.where(cand, sig.pow(cfg.alpha) * ov.pow(cfg.beta), 0.0)
            return assignment_from_metric(align, ov, cand, gt[..., 0], cfg)

    @override
    def semantic_term(self, semantic: torch.Tensor | None, batch: dict[str, torch.Tensor], done: Assigned
                      ) -> torch.Tensor:
        """``sem_loss`` times the ``box`` gain (the module docstring)."""
        if semantic is None:
            return done.gt.new_zeros(())
        B, nc, sh, sw = semantic.shape
        with torch.autocast(semantic.device.type, enabled=False):
            classes = batch[SEMANTIC_KEY].to(semantic.device).long()  # (B, h, w)
            if self.overlap:
                covered = batch["masks"].to(semantic.device) != 0
            else:
                covered = self.masks(batch, done.gt.shape[1], semantic.device).sum(1) != 0
            target = torch.zeros(B, nc, *classes.shape[-2:], device=semantic.device)
            target.scatter_(1, classes[:, None], covered[:, None].float())
            if target.shape[-2:] != (sh, sw):
                target = F.interpolate(target, (sh, sw), mode="nearest")
            logits = semantic.float()
            bce = F.binary_cross_entropy_with_logits(logits, target)
            p = logits.sigmoid()
            inter = (p * target).sum((2, 3))
            union = p.sum((2, 3)) + target.sum((2, 3))
            dice = 1.0 - (2.0 * inter + 1.0) / (union + 1.0)
            sem = 0.5 * bce + 0.5 * dice.mean(1).mean()
            found = (done.assignment.gidx >= 0).any()
            return torch.where(found, sem, 0.0) * float(self.hyp.box)


class FusedE2ESegment26Loss(FusedE2ELoss):
    """FusedE2ELoss over FusedSegment26Loss: ultralytics' ``E2ELoss(model, SegmentLoss26)``, what
    YOLO26's end-to-end segmentation models train with."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, FusedSegment26Loss)


__all__ = ["SEMANTIC_KEY", "FusedE2ESegment26Loss", "FusedSegment26Loss"]
