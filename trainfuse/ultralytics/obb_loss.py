"""FusedOBBLoss: ultralytics' ``v8OBBLoss`` without host syncs.

Same constructor (``model, tal_topk=10, tal_topk2=None``), same call (``preds, batch``), same
result: ``(loss * batch_size, {"box_loss", "cls_loss", "dfl_loss", "angle_loss"})``, the rotated
task-aligned assignment and the four terms over the foreground anchors ``F`` with their target
scores ``t`` and ``tss = max(sum t, 1)``::

    box   = sum_F t (1 - ProbIoU(pred, target)) / tss          (ProbIoU's covariance floor 0.01)
    dfl   = sum_F t DFL(logits, rotated ltrb distances) / tss
    cls   = sum_{a, c} w_c BCE(score, t one_hot(label)) / tss
    angle = sum_F t exp(-log(w / h)^2 / 9) sin(2 wrap(theta_pred - theta))^2 / tss

ultralytics pads the labels to a maximum read from the GPU, gathers the assigner's candidates
with ``nonzero`` and branches on ``fg_mask.sum()`` (host syncs each step, and a new shape whenever
the largest label count changes). Here the labels come padded from the CPU
(``batch["padded_targets"]``, six columns: class and normalized ``xywhr``), the assigner's metric
runs over every (image, label, anchor) and the terms over every anchor with the background
weighing zero, so every shape depends on the batch, the anchors and the label capacity only and a
step can be captured in a CUDA graph. Labels under 2 pixels wide or high are dropped as
ultralytics drops them (zeroed: a padding row). The rotated geometry is ultralytics' own
(``probiou``, ``dist2rbox``, ``rbox2dist``, the in-box test); the DFL expectation is
:func:`~trainfuse.losses.detection.assigner.distances`' (a sum where ultralytics multiplies by a
matrix: the last float32 bit may differ). Heads with DFL (``reg_max > 1``: YOLOv8 and YOLO11 OBB)
and without (YOLO26: ``l1_loss``, the L1 of the ltrb distances as fractions of the image, in
ultralytics' place of DFL); YOLO26's end-to-end head trains with ``FusedE2ELoss(model,
FusedOBBLoss)``, as ultralytics' ``E2ELoss(model, v8OBBLoss)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from trainfuse.losses.detection import PADDED_KEY, AssignConfig, anchor_grid, pad_targets, target_capacity
from trainfuse.losses.detection.assigner import assignment_from_metric, distances
from trainfuse.losses.detection.targets import device_values
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss


def in_rotated_boxes(centres: torch.Tensor, gt: torch.Tensor, valid: torch.Tensor, stride_val: float
                     ) -> torch.Tensor:
    """``(B, M, A)``: anchor centre ``(A, 2)`` inside label ``(B, M, 5)`` (pixels ``xywhr``), sides
    under ``stride_val`` widened to it (``RotatedTaskAlignedAssigner.select_candidates_in_gts``)."""
    from ultralytics.utils.ops import xywhr2xyxyxyxy

    wh = gt[..., 2:4]
    wh = torch.where((wh < stride_val) & valid[..., None], torch.full_like(wh, stride_val), wh)
    corners = xywhr2xyxyxyxy(torch.cat((gt[..., :2], wh, gt[..., 4:5]), -1))
    a, b, _, d = corners.split(1, dim=-2)
    ab, ad = b - a, d - a
    apx = centres[:, 0] - a[..., 0]
    apy = centres[:, 1] - a[..., 1]
    norm_ab, norm_ad = (ab * ab).sum(-1), (ad * ad).sum(-1)
    ap_ab = apx * ab[..., 0] + apy * ab[..., 1]
    ap_ad = apx * ad[..., 0] + apy * ad[..., 1]
    return (ap_ab >= 0) & (ap_ab <= norm_ab) & (ap_ad >= 0) & (ap_ad <= norm_ad)


class FusedOBBLoss:
    """Drop-in for ultralytics' ``v8OBBLoss`` (see the module docstring).

    Args:
        model: the de-paralleled ``OBBModel``: reads ``model.args`` (the ``box``, ``cls``, ``dfl``
            and ``angle`` gains), its head (``nc``, ``reg_max``, ``stride``) and
            ``model.class_weights`` if set.
        tal_topk: the assigner's k.
        tal_topk2: its second k (None: ``tal_topk``).

    Attributes:
        graph_keys: the batch keys besides ``"img"`` a training step reads (the padded labels).
    """

    graph_keys: tuple[str, ...] | None = (PADDED_KEY,)

    def __init__(self, model: torch.nn.Module, tal_topk: int = 10, tal_topk2: int | None = None) -> None:
        head = model.model[-1]
        self.hyp = model.args
        self.nc, self.reg_max = head.nc, head.reg_max
        self.device = next(model.parameters()).device
        self.loss_names = "box_loss", "cls_loss", "dfl_loss" if self.reg_max > 1 else "l1_loss", "angle_loss"
        cw = getattr(model, "class_weights", None)
        self.class_weights = (None if cw is None
                              else cw.to(device=self.device, dtype=torch.float32).reshape(-1))
        self._strides = tuple(float(s) for s in head.stride.tolist())
        self.assign_config = AssignConfig(topk=tal_topk, topk2=tal_topk2 or tal_topk, alpha=0.5, beta=6.0,
                                          stride_val=self._strides[1] if len(self._strides) > 1
                                          else self._strides[0])

    def __call__(self, preds: dict | tuple, batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss * batch_size, {name: detached term})``, as ``v8OBBLoss``."""
        return self.loss(self.parse_output(preds), batch)

    def parse_output(self, preds: dict | tuple) -> dict[str, Any]:
        """The training outputs dict (the second element of an ``(inference, dict)`` tuple)."""
        return preds[1] if isinstance(preds, tuple) else preds

    def targets(self, batch: dict[str, torch.Tensor], batch_size: int, device: torch.device) -> torch.Tensor:
        """The padded labels ``(B, M, 6)``: class and normalized ``xywhr``, zero rows as padding
        (``batch[PADDED_KEY]`` if the trainer put them there; else padded here, one host sync
        on a GPU for the capacity)."""
        padded = batch.get(PADDED_KEY)
        if padded is None:
            cap = target_capacity(batch["batch_idx"], batch_size)
            padded = pad_targets(batch["batch_idx"], batch["cls"], batch["bboxes"], batch_size, cap)
        if padded.dim() != 3 or padded.shape[0] != batch_size or padded.shape[-1] != 6:
            raise ValueError(f"FusedOBBLoss: batch[{PADDED_KEY!r}] must have shape ({batch_size}, capacity, "
                             f"6), got {tuple(padded.shape)}")
        return padded.to(device=device, dtype=torch.float32, non_blocking=True)

    def loss(self, preds: dict[str, Any], batch: dict[str, torch.Tensor], gt: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``preds`` (``boxes (B, 4 reg_max, A)``, ``scores (B, nc, A)``,
        ``angle (B, 1, A)``, ``feats``)."""
        from ultralytics.utils.metrics import probiou
        from ultralytics.utils.tal import dist2rbox, rbox2dist

        boxes, scores, angle, feats = preds["boxes"], preds["scores"], preds["angle"], preds["feats"]
        B, _, A = scores.shape
        if boxes.shape != (B, 4 * self.reg_max, A) or scores.shape[1] != self.nc or angle.shape != (B, 1, A):
            raise ValueError(f"FusedOBBLoss: preds['boxes'] must be ({B}, {4 * self.reg_max}, {A}), "
                             f"preds['scores'] ({B}, {self.nc}, {A}) and preds['angle'] ({B}, 1, {A}); got "
                             f"{tuple(boxes.shape)}, {tuple(scores.shape)}, {tuple(angle.shape)}")
        dev = scores.device
        sizes = tuple((int(f.shape[2]), int(f.shape[3])) for f in feats)
        anchors, stride_col = anchor_grid(sizes, self._strides, dev)
        h, w = sizes[0][0] * self._strides[0], sizes[0][1] * self._strides[0]
        if gt is None:  # (FusedE2ELoss gives both branches the labels it padded once)
            gt = self.targets(batch, B, dev)
        with torch.autocast(dev.type, enabled=False):
            scale = device_values(gt, (w, h, w, h))
            px = gt[..., 1:5] * scale
            kept = (px[..., 2] >= 2) & (px[..., 3] >= 2)  # ultralytics drops labels under 2 pixels
            gtb = torch.where(kept[..., None], torch.cat((px, gt[..., 5:6]), -1), 0.0)  # (B, M, 5) pixels
            labels = torch.where(kept, gt[..., 0], 0.0)
            valid = gtb.sum(-1) > 0
            ct = torch.promote_types(scores.dtype, torch.float32)
            theta = angle.to(ct).transpose(1, 2)  # (B, A, 1)
            pred = torch.cat((dist2rbox(distances(boxes), theta, anchors), theta), -1)  # grid units xywhr
            with torch.no_grad():
                pd = torch.cat((pred[..., :4] * stride_col, pred[..., 4:]), -1)
                cand = in_rotated_boxes(anchors * stride_col, gtb, valid, self.assign_config.stride_val)
                cand &= valid[..., None]
                M = gtb.shape[1]  # probiou takes (N, 5) rows: every (label, anchor) pair as one
                pairs = (gtb[:, :, None].expand(B, M, A, 5).reshape(-1, 5),
                         pd[:, None].expand(B, M, A, 5).reshape(-1, 5))
                ov = probiou(*pairs).view(B, M, A).clamp(0)
                ov = torch.where(cand, ov, 0.0)
                sig = scores.to(ct).sigmoid().gather(1, labels.long()[..., None].expand(B, -1, A))
                cfg = self.assign_config
                align = torch.where(cand, sig.pow(cfg.alpha) * ov.pow(cfg.beta), 0.0)
                asg = assignment_from_metric(align, ov, cand, labels, self.assign_config)
            fg = asg.gidx >= 0
            t, tss = asg.t, asg.tss
            # class term over every anchor
            onehot = F.one_hot(asg.label.long().clamp(0), self.nc).to(ct) * (t * fg)[..., None]
            bce = F.binary_cross_entropy_with_logits(scores.to(ct).transpose(1, 2), onehot, reduction="none")
            if self.class_weights is not None:
                bce = bce * self.class_weights
            cls = bce.sum() / tss
            # box, DFL and angle terms; the background's targets are its own prediction (finite, weighing 0)
            target = torch.gather(gtb, 1, asg.gidx.long().clamp(0)[..., None].expand(B, A, 5))
            target = torch.cat((target[..., :4] / stride_col, target[..., 4:]), -1)
            target = torch.where(fg[..., None], target, pred.detach())
            weight = torch.where(fg, t, 0.0)
            iou = probiou(pred.reshape(-1, 5), target.reshape(-1, 5), floor=0.01).view(B, A)
            box = ((1.0 - iou) * weight).sum() / tss
            if self.reg_max > 1:
                ltrb = rbox2dist(target[..., :4], anchors, target[..., 4:5], reg_max=self.reg_max - 1)
                dfl = self._dfl(boxes.to(ct), ltrb)  # (B, A)
            else:  # ultralytics' L1 of the distances as fractions of the image (scale: w, h, w, h)
                ltrb = rbox2dist(target[..., :4], anchors, target[..., 4:5]) * stride_col / scale
                dfl = (distances(boxes) * stride_col / scale - ltrb).abs().mean(-1)
            dfl = (dfl * weight).sum() / tss
            # the background's own prediction may have a negative side (no DFL: raw distances): its
            # aspect is taken as 1, not a NaN that a zero weight would keep (0 * NaN) in the sum and grads
            aspect = torch.where(fg[..., None], target[..., 2:4], 1.0)
            log_ar = torch.log((aspect[..., 0] + 1e-9) / (aspect[..., 1] + 1e-9))
            delta = pred[..., 4] - target[..., 4]
            wrapped = delta - torch.round(delta / math.pi) * math.pi
            ang = torch.exp(-(log_ar**2) / 9) * torch.sin(2 * wrapped) ** 2
            ang = (ang * weight).sum() / tss
            gains = device_values(scale, (float(self.hyp.box), float(self.hyp.cls), float(self.hyp.dfl),
                                          float(self.hyp.angle)))
            items = torch.stack((box, cls, dfl, ang)) * gains
        return items * B, dict(zip(self.loss_names, items.detach()))

    def _dfl(self, boxes: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """ultralytics' ``DFLoss`` per anchor, ``(B, A)``: the mean over the four sides of the
        cross-entropy of the logits ``(B, 4R, A)`` with the two bins around ``target (B, A, 4)``."""
        B, _, A = boxes.shape
        R = self.reg_max
        target = target.clamp(0, R - 1 - 0.01)
        left = target.long()
        wl = left + 1 - target
        logp = F.log_softmax(boxes.view(B, 4, R, A).permute(0, 3, 1, 2), dim=-1)  # (B, A, 4, R)
        pl = logp.gather(-1, left[..., None]).squeeze(-1)
        pr = logp.gather(-1, (left + 1)[..., None]).squeeze(-1)
        return -(pl * wl + pr * (1 - wl)).mean(-1)


class FusedE2EOBBLoss(FusedE2ELoss):
    """FusedE2ELoss over FusedOBBLoss: ultralytics' ``E2ELoss(model, v8OBBLoss)``, what YOLO26's
    end-to-end OBB models train with."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, FusedOBBLoss)


__all__ = ["FusedE2EOBBLoss", "FusedOBBLoss", "in_rotated_boxes"]
