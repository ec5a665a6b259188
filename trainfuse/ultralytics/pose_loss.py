"""FusedPoseLoss: ultralytics' ``v8PoseLoss`` without host syncs.

Same constructor (``model, tal_topk=10, tal_topk2=None``), same call (``preds, batch``), same
result: ``(loss * batch_size, {"box_loss", "pose_loss", "kobj_loss", "cls_loss", "dfl_loss"})``.
The box, class and DFL terms and the assignment are :class:`~trainfuse.ultralytics.
FusedDetectionLoss`'s; the keypoint terms are ultralytics' over the foreground anchors ``F``,
each with its assigned label's keypoints ``g`` (visibility ``v``) and box area ``s`` (in grid
units)::

    pose = sum_{f in F, k} K / (sum_k [v != 0] + 1e-9) (1 - exp(-d_fk / ((2 sigma_k)^2 (s_f + 1e-9) 2)))
           [v_fk != 0] / (|F| K)
    kobj = sum_{f in F, k} BCE(visibility logit_fk, [v_fk != 0]) / (|F| K)

both 0 without foreground, ``d`` the squared distance of the decoded keypoint (grid units) to the
label's. ultralytics gathers the foreground with ``nonzero`` and branches on ``masks.any()`` (two
host syncs a step); here every anchor is computed and the background weighs zero, so every shape
depends on the batch, the anchors and the label capacity only and a step can be captured in a
CUDA graph. The keypoints come padded in the labels' slots from ``batch["padded_keypoints"]``
(:func:`~trainfuse.losses.detection.targets.add_padded_targets` on the CPU); without them the
padding costs one host sync. The keypoint terms compute in float32 (ultralytics mixes in the
predictions' float16 under AMP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from trainfuse.losses.detection.targets import (
    PADDED_KEY,
    PADDED_KEYPOINTS_KEY,
    device_values,
    label_pixels,
    pad_rows,
)
from trainfuse.ultralytics.loss import Assigned, FusedDetectionLoss


def oks_sigmas(model: torch.nn.Module, nkpt: int, device: torch.device) -> torch.Tensor:
    """``v8PoseLoss``'s sigmas: ``model.kpt_oks_sigmas`` if set (``nkpt`` positive values), else
    COCO's for a 17-keypoint head, else ``1 / nkpt`` each."""
    sigmas = getattr(model, "kpt_oks_sigmas", None)
    if sigmas is None:
        if nkpt == 17:
            from ultralytics.utils.metrics import OKS_SIGMA

            return torch.as_tensor(OKS_SIGMA, dtype=torch.float32, device=device)
        return torch.full((nkpt,), 1.0 / nkpt, device=device)
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32, device=device).flatten()
    if len(sigmas) != nkpt or not torch.all(sigmas > 0):
        raise ValueError(f"FusedPoseLoss: 'kpt_oks_sigmas' must be {nkpt} positive values, got "
                         f"{sigmas.tolist()}")
    return sigmas


class FusedPoseLoss(FusedDetectionLoss):
    """Drop-in for ultralytics' ``v8PoseLoss`` (see the module docstring).

    Args:
        model: the de-paralleled ``PoseModel`` (a ``Pose`` head: ``kpt_shape``); reads what
            :class:`~trainfuse.ultralytics.FusedDetectionLoss` reads, the ``pose`` and ``kobj``
            gains and ``model.kpt_oks_sigmas`` if set.
        tal_topk: the assigner's k.
        tal_topk2: its second k (None: ``tal_topk``).

    Attributes:
        graph_keys: the batch keys besides ``"img"`` a training step reads: the padded labels and
            their keypoints.
    """

    graph_keys: tuple[str, ...] | None = (PADDED_KEY, PADDED_KEYPOINTS_KEY)

    def __init__(self, model: torch.nn.Module, tal_topk: int = 10, tal_topk2: int | None = None) -> None:
        super().__init__(model, tal_topk, tal_topk2)
        self.kpt_shape = tuple(int(v) for v in model.model[-1].kpt_shape)
        if len(self.kpt_shape) != 2 or self.kpt_shape[1] not in (2, 3):
            raise ValueError(f"FusedPoseLoss: the head's kpt_shape must be (keypoints, 2 or 3), got "
                             f"{self.kpt_shape}")
        self.loss_names = ("box_loss", "pose_loss", "kobj_loss", *self.loss_names[1:])
        self.sigmas = oks_sigmas(model, self.kpt_shape[0], self.device)

    def keypoints(self, batch: dict[str, torch.Tensor], batch_size: int, capacity: int, device: torch.device
                  ) -> torch.Tensor:
        """The labels' keypoints ``(B, capacity, K, 3)`` (normalized ``x, y``, visibility; 1 where
        the dataset has none) in the padded labels' slots: ``batch["padded_keypoints"]`` if the
        trainer put them there, else padded here."""
        padded = batch.get(PADDED_KEYPOINTS_KEY)
        if padded is None:
            padded = pad_rows(batch["batch_idx"], batch["keypoints"], batch_size, capacity)
        if padded.shape[-1] == 2:  # no visibility flag: every keypoint counts
            padded = torch.cat((padded, torch.ones_like(padded[..., :1])), -1)
        K = self.kpt_shape[0]
        if padded.dim() != 4 or padded.shape[1] != capacity or padded.shape[2:] != (K, 3):
            raise ValueError(f"FusedPoseLoss: the padded keypoints must have shape (batch, {capacity}, {K}, "
                             f"3), got {tuple(padded.shape)}")
        return padded.to(device=device, dtype=torch.float32, non_blocking=True)

    @override
    def loss(self, preds: dict[str, Any], batch: dict[str, torch.Tensor], gt: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``preds`` (the detection outputs and ``kpts (B, K * D, A)``)."""
        if gt is None:  # (without batch["padded_targets"], one host sync on a GPU for the capacity)
            gt = self.targets(batch, preds["scores"].shape[0], preds["scores"].device)
        det, items, done = self.detection(preds, batch, gt)
        kpts = self.keypoints(batch, *done.gt.shape[:2], done.gt.device)
        pose, kobj = self.keypoint_terms(preds["kpts"], done, kpts)
        gains = (float(self.hyp.pose), float(self.hyp.kobj))
        B = done.gt.shape[0]
        terms = torch.stack((pose * gains[0], kobj * gains[1]))
        extra = self.extra_terms(preds, done, kpts)
        out = torch.cat((det[:1], terms * B, det[1:], extra * B))
        shown = torch.cat((items[:1], terms.detach(), items[1:], extra.detach()))
        return out, dict(zip(self.loss_names, shown))

    def extra_terms(self, preds: dict[str, Any], done: Assigned, kpts: torch.Tensor) -> torch.Tensor:
        """Terms after the detection ones, gain-scaled, ``(E,)``: none for v8's pose loss."""
        return done.gt.new_zeros(0)

    @staticmethod
    def decode_keypoints(xy: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The predicted keypoints ``(B, A, K, 2)`` in grid units, as ``v8PoseLoss.kpts_decode``."""
        return xy * 2.0 + (anchors - 0.5).view(1, -1, 1, 2)

    def keypoint_terms(self, pred: torch.Tensor, done: Assigned, kpts: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pose, kobj)`` of the module docstring, before their gains, for ``pred (B, K * D, A)``
        given the assignment ``done`` and the padded keypoints ``kpts (B, M, K, 3)``."""
        K, D = self.kpt_shape
        B, _, A = pred.shape
        with torch.autocast(pred.device.type, enabled=False):
            p = pred.float().permute(0, 2, 1).reshape(B, A, K, D)
            anchors, strides = done.anchors, done.strides  # (A, 2) grid units, (A, 1)
            xy = self.decode_keypoints(p[..., :2], anchors)  # grid units
            gidx = done.assignment.gidx.long()
            fg = gidx >= 0  # (B, A)
            rows = gidx.clamp(min=0)
            gt_k = torch.gather(kpts, 1, rows.view(B, A, 1, 1).expand(B, A, K, 3))  # (B, A, K, 3)
            h, w = done.imgsz
            scale = device_values(kpts, (w, h))
            gt_xy = gt_k[..., :2] * scale / strides.view(1, A, 1, 1)
            boxes = torch.gather(label_pixels(done.gt, done.imgsz), 1, rows.unsqueeze(-1).expand(B, A, 4))
            boxes = boxes / strides.view(1, A, 1)
            area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])  # (B, A)
            area = torch.where(fg, area, 1.0)  # background: any finite area (weighs zero)
            seen = (gt_k[..., 2] != 0) & fg.unsqueeze(-1)  # (B, A, K)
            seen_f = seen.float()
            d = (xy - gt_xy).pow(2).sum(-1)
            e = d / ((2 * self.sigmas).pow(2) * (area.unsqueeze(-1) + 1e-9) * 2)
            factor = K / (seen_f.sum(-1, keepdim=True) + 1e-9)
            count = (fg.sum() * K).clamp(min=1).float()  # |F| K, 1 without foreground (the sums are 0 then)
            pose = (factor * (1 - torch.exp(-e)) * seen_f).sum() / count
            if D == 3:
                bce = F.binary_cross_entropy_with_logits(p[..., 2], seen_f, reduction="none")
                kobj = torch.where(fg.unsqueeze(-1), bce, 0.0).sum() / count
            else:
                kobj = pose.new_zeros(())
        return pose, kobj


__all__ = ["FusedPoseLoss", "oks_sigmas"]
