"""FusedSegmentationLoss: ultralytics' ``v8SegmentationLoss`` without host syncs.

Same constructor (``model, tal_topk=10, tal_topk2=None``), same call (``preds, batch``), same
result: ``(loss * batch_size, {"box_loss", "seg_loss", "cls_loss", "dfl_loss", "sem_loss"})``.
The box, class and DFL terms and the assignment are :class:`~trainfuse.ultralytics.
FusedDetectionLoss`'s; the mask term is ultralytics', over the foreground anchors ``F``, each with
its assigned label's mask ``g``, box ``b`` and box area ``s`` (a fraction of the image)::

    seg = sum_{f in F} mean_{pixels} crop_b(BCE(coefficients_f . proto, g)) / s_f / |F|     (0 without F)

ultralytics loops over the images, branches on ``fg_mask_i.any()`` and gathers the foreground
with boolean indexing (host syncs, and shapes that change every step). Here each image's
foreground anchors are gathered into a fixed number of slots, ``min(anchors, topk * capacity)``
(a label keeps at most ``topk`` anchors), in anchor order, the unused slots weighing zero: every
shape depends on the batch, the anchors, the label capacity and the mask size only, and a step
can be captured in a CUDA graph. The masks are ultralytics' own: with ``overlap_mask`` (its
default) one map per image whose value ``j + 1`` marks the image's ``j``-th label, else one mask
per label, padded on the CPU into the labels' slots (``batch["padded_masks"]``; without them the
loss pads them itself). The slots' cropped BCE sums come from
:func:`~trainfuse.losses.mask_bce.cropped_mask_bce` (on CUDA three Triton launches that never make
the slots' full-size logit, target or crop tensors). Heads of YOLOv8 and YOLO11 (``Segment``, no
semantic branch: ``sem_loss`` is 0, as ultralytics reports it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from trainfuse.losses.detection.targets import PADDED_KEY, device_values, label_pixels, pad_rows
from trainfuse.losses.mask_bce import cropped_mask_bce
from trainfuse.ultralytics.loss import Assigned, FusedDetectionLoss

PADDED_MASKS_KEY = "padded_masks"  # overlap_mask=False: (B, capacity, H, W), the rows of padded_targets


class FusedSegmentationLoss(FusedDetectionLoss):
    """Drop-in for ultralytics' ``v8SegmentationLoss`` (see the module docstring).

    Args:
        model: the de-paralleled ``SegmentationModel`` (a ``Segment`` head); reads what
            :class:`~trainfuse.ultralytics.FusedDetectionLoss` reads and ``model.args.overlap_mask``.
        tal_topk: the assigner's k.
        tal_topk2: its second k (None: ``tal_topk``).

    Attributes:
        graph_keys: the batch keys besides ``"img"`` a training step reads: the padded labels and
            ``"masks"``, the images' index maps of ``overlap_mask=True``; None with
            ``overlap_mask=False``, whose masks come one per label, their count changing from batch
            to batch (no fixed shape for a CUDA graph).
    """

    def __init__(self, model: torch.nn.Module, tal_topk: int = 10, tal_topk2: int | None = None) -> None:
        super().__init__(model, tal_topk, tal_topk2)
        self.loss_names = ("box_loss", "seg_loss", *self.loss_names[1:], "sem_loss")
        self.overlap = bool(model.args.overlap_mask)
        self.graph_keys = (PADDED_KEY, "masks") if self.overlap else None

    @override
    def loss(self, preds: dict[str, Any], batch: dict[str, torch.Tensor], gt: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``preds`` (the detection outputs, ``mask_coefficient (B, nm, A)`` and
        ``proto (B, nm, h, w)``)."""
        proto, semantic = self.split_proto(preds["proto"])
        if gt is None:  # (without batch["padded_targets"], one host sync on a GPU for the capacity)
            gt = self.targets(batch, preds["scores"].shape[0], preds["scores"].device)
        det, items, done = self.detection(preds, batch, gt)
        seg = self.mask_term(preds["mask_coefficient"], proto, batch, done) * float(self.hyp.box)
        sem = self.semantic_term(semantic, batch, done).view(1)  # (gain-scaled)
        B = gt.shape[0]
        out = torch.cat((det[:1], (seg * B).view(1), det[1:], sem * B))
        shown = torch.cat((items[:1], seg.detach().view(1), items[1:], sem.detach()))
        return out, dict(zip(self.loss_names, shown))

    def split_proto(self, proto: torch.Tensor | tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(prototypes, semantic logits or None)`` of the head's ``proto`` output."""
        if isinstance(proto, tuple):
            raise ValueError("FusedSegmentationLoss: the head has a semantic branch (Segment26); train it "
                             "with FusedSegment26Loss (inside FusedE2ELoss) or ultralytics' own loss")
        return proto, None

    def semantic_term(self, semantic: torch.Tensor | None, batch: dict[str, torch.Tensor], done: Assigned
                      ) -> torch.Tensor:
        """``sem_loss`` times its gain: 0 for heads without a semantic branch."""
        return done.gt.new_zeros(())

    def masks(self, batch: dict[str, torch.Tensor], capacity: int, device: torch.device) -> torch.Tensor:
        """The labels' masks: ``(B, h, w)`` index maps with ``overlap_mask``, else ``(B, capacity,
        h, w)`` in the labels' slots (``batch["padded_masks"]`` or padded here)."""
        if self.overlap:
            return batch["masks"].to(device=device, non_blocking=True)
        padded = batch.get(PADDED_MASKS_KEY)
        if padded is None:
            padded = pad_rows(batch["batch_idx"], batch["masks"], batch["img"].shape[0], capacity)
        if padded.dim() != 4 or padded.shape[1] != capacity:
            raise ValueError(f"FusedSegmentationLoss: batch[{PADDED_MASKS_KEY!r}] must have shape (batch, "
                             f"{capacity}, h, w), got {tuple(padded.shape)}")
        return padded.to(device=device, non_blocking=True)

    def mask_term(self, coefficients: torch.Tensor, proto: torch.Tensor, batch: dict[str, torch.Tensor],
                  done: Assigned) -> torch.Tensor:
        """``seg`` of the module docstring, before its gain (``hyp.box``)."""
        B, nm, A = coefficients.shape
        M = done.gt.shape[1]
        masks = self.masks(batch, M, coefficients.device)
        with torch.autocast(coefficients.device.type, enabled=False):
            ct = torch.promote_types(coefficients.dtype, torch.float32)
            proto = proto.to(ct)
            mh, mw = masks.shape[-2:]
            if proto.shape[-2:] != (mh, mw):
                proto = F.interpolate(proto, (mh, mw), mode="bilinear", align_corners=False)
            gidx = done.assignment.gidx.long()
            fg = gidx >= 0
            C = min(A, self.assign_config.topk * M)  # a label keeps at most topk anchors
            slots = torch.sort((~fg).to(torch.int8), dim=1, stable=True).indices[:, :C]  # foreground first
            used = fg.gather(1, slots)  # (B, C)
            rows = gidx.gather(1, slots).clamp(min=0)
            coef = coefficients.to(ct).gather(2, slots[:, None].expand(B, nm, C))  # (B, nm, C)
            h, w = done.imgsz
            box = torch.gather(label_pixels(done.gt, done.imgsz), 1, rows[..., None].expand(B, C, 4))
            norm = box / device_values(box, (w, h, w, h))
            area = (norm[..., 2] - norm[..., 0]) * (norm[..., 3] - norm[..., 1])
            crop = norm * device_values(box, (mw, mh, mw, mh))  # (B, C, 4) in mask pixels
            index = rows + 1 if self.overlap else rows  # the slot's number in the index map, or its row
            sums = cropped_mask_bce(coef, proto, masks, index, crop, overlap=self.overlap)
            per = sums / (mh * mw) / torch.where(used, area, 1.0)
            count = fg.sum().clamp(min=1).to(ct)
            return torch.where(used, per, 0.0).sum() / count


__all__ = ["PADDED_MASKS_KEY", "FusedSegmentationLoss"]
