"""FusedPose26Loss: ultralytics' ``PoseLoss26`` (YOLO26's pose head) without host syncs.

Same constructor and call as :class:`~trainfuse.ultralytics.pose_loss.FusedPoseLoss`, the branch
loss of :class:`~trainfuse.ultralytics.FusedE2ELoss` for YOLO26's end-to-end pose head
(``FusedE2ELoss(model, FusedPose26Loss)``, as ultralytics builds ``E2ELoss(model, PoseLoss26)``).
What YOLO26 changes from v8's pose loss, each as ultralytics has it:

- **the assignment** (``PoseTaskAlignedAssigner``): a pair's overlap is the keypoints' OKS (the
  box IoU for a label without visible keypoints), the label's area taken as 0.53 of its box's; and
  a label is a candidate only on the pyramid levels whose stride ``s`` fits its size,
  ``2 s <= sqrt(w h) <= 12 s`` (the finest level open below, the coarsest above; a label the gate
  would leave without candidates keeps them all). Dense over ``(B, M, A)`` in torch operations,
  then the detection loss's top-k, resolution and target scores (``assignment_from_metric``).
- **the decode**: keypoints ``p + anchor`` in grid units (v8: ``2 p + anchor - 0.5``).
- **the RLE term** (heads with a flow model): for each foreground anchor's visible keypoint, the
  error ``e = (p - g) / (sigmoid(sigma) + 1e-9)`` (clamped to +-100; non-finite errors dropped),

      rle = sum_k w_k (log sigma + log 2 sigma + |e| - log_phi(e)) / N,    clamped at 0

  ``log_phi`` the head's RealNVP, ``w`` the 17 COCO keypoints' ``RLE_WEIGHT`` (else ones), ``N``
  the visible keypoints counted. ultralytics gathers them by boolean indexing (shapes that change
  every step); here each image's foreground anchors fill a fixed number of slots (``topk`` times
  the label capacity), the unused slots weighing zero, as the segmentation loss's mask term does.
  The flow runs under the caller's autocast, as in ultralytics.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from trainfuse.losses.detection.assigner import Assignment, assignment_from_metric, metric_torch
from trainfuse.losses.detection.targets import device_values, label_pixels
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss
from trainfuse.ultralytics.loss import Assigned
from trainfuse.ultralytics.pose_loss import FusedPoseLoss

LEVEL_RANGE = (2.0, 12.0)  # PoseTaskAlignedAssigner.level_range: a label's size in strides
OKS_AREA = 0.53  # the box-area factor of PoseValidator's OKS, which the assigner takes
RLE_CLAMP = 100.0


class FusedPose26Loss(FusedPoseLoss):
    """Drop-in for ultralytics' ``PoseLoss26`` (see the module docstring).

    Args:
        model: the de-paralleled ``PoseModel`` with a ``Pose26`` head; read as
            :class:`~trainfuse.ultralytics.pose_loss.FusedPoseLoss` reads it, and the head's
            ``flow_model`` (the RLE term, ``rle_loss``) and the ``rle`` gain where it has one.
        tal_topk: the assigner's k.
        tal_topk2: its second k (None: ``tal_topk``).
    """

    def __init__(self, model: torch.nn.Module, tal_topk: int = 10, tal_topk2: int | None = None) -> None:
        super().__init__(model, tal_topk, tal_topk2)
        self.flow_model = getattr(model.model[-1], "flow_model", None)
        if self.flow_model is not None:
            from ultralytics.utils.metrics import RLE_WEIGHT

            self.loss_names = (*self.loss_names, "rle_loss")
            weights = RLE_WEIGHT if self.kpt_shape == (17, 3) else [1.0] * self.kpt_shape[0]
            self.rle_weights = torch.as_tensor(weights, dtype=torch.float32, device=self.device)

    @staticmethod
    @override
    def decode_keypoints(xy: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The predicted keypoints ``(B, A, K, 2)`` in grid units, as ``PoseLoss26.kpts_decode``."""
        return xy + anchors.view(1, -1, 1, 2)

    @override
    def assign(self, boxes: torch.Tensor, scores: torch.Tensor, gt: torch.Tensor, imgsz: tuple[float, float],
               anchors: torch.Tensor, strides: torch.Tensor, preds: dict[str, Any],
               batch: dict[str, torch.Tensor], *, fused: bool) -> Assignment:
        """``PoseTaskAlignedAssigner``'s assignment (the module docstring), dense in torch."""
        with torch.no_grad():
            cfg = self.assign_config
            _, iou, cand = metric_torch(boxes, scores, gt, imgsz, anchors, strides, cfg)
            B, M, A = cand.shape
            K = self.kpt_shape[0]
            gtb = label_pixels(gt, imgsz)  # (B, M, 4) xyxy pixels
            wh = gtb[..., 2:] - gtb[..., :2]
            side = wh.prod(-1).clamp(min=0).sqrt()[..., None]  # (B, M, 1)
            lo, hi = LEVEL_RANGE
            s = strides.view(1, 1, A)
            gated = cand & ((side >= lo * s) | (s == s.min())) & ((side <= hi * s) | (s == s.max()))
            cand = torch.where(gated.any(-1, keepdim=True), gated, cand)
            p = preds["kpts"].detach().float().permute(0, 2, 1).reshape(B, A, K, -1)
            pd = self.decode_keypoints(p[..., :2], anchors) * strides.view(1, A, 1, 1)  # (B, A, K, 2) pixels
            kpts = self.keypoints(batch, B, M, gt.device)  # (B, M, K, 3), x and y normalized
            h, w = imgsz
            gk = kpts[..., :2] * device_values(kpts, (w, h))
            vis = kpts[..., 2] > 0  # (B, M, K)
            area = wh.prod(-1) * OKS_AREA  # (B, M)
            d = (pd[:, None] - gk[:, :, None]).pow(2).sum(-1)  # (B, M, A, K)
            e = d / ((2 * self.sigmas).pow(2) * (area[..., None, None] + cfg.eps) * 2)
            oks = (torch.exp(-e) * vis[:, :, None]).sum(-1) / vis.sum(-1, keepdim=True).clamp(min=1)
            ov = torch.where(cand, torch.where(vis.any(-1, keepdim=True), oks, iou), 0.0)
            sig = scores.float().sigmoid().gather(1, gt[..., 0].long()[..., None].clamp(0).expand(B, M, A))
            align = torch.where(cand, sig.pow(cfg.alpha) * ov.pow(cfg.beta), 0.0)
            return assignment_from_metric(align, ov, cand, gt[..., 0], cfg)

    @override
    def extra_terms(self, preds: dict[str, Any], done: Assigned, kpts: torch.Tensor) -> torch.Tensor:
        """``rle`` times its gain, ``(1,)`` (none without a flow model)."""
        if self.flow_model is None:
            return done.gt.new_zeros(0)
        if preds.get("kpts_sigma") is None:  # (as ultralytics: no sigmas, no term)
            return done.gt.new_zeros(1)
        return (self.rle_term(preds["kpts"], preds["kpts_sigma"], done, kpts) * float(self.hyp.rle)).view(1)

    def rle_term(self, pred: torch.Tensor, sigma: torch.Tensor, done: Assigned, kpts: torch.Tensor
                 ) -> torch.Tensor:
        """``rle`` of the module docstring, before its gain, over the foreground anchors' slots."""
        K, D = self.kpt_shape
        B, _, A = pred.shape
        M = done.gt.shape[1]
        gidx = done.assignment.gidx.long()
        fg = gidx >= 0
        C = min(A, self.assign_config.topk * M)  # a label keeps at most topk anchors
        slots = torch.sort((~fg).to(torch.int8), dim=1, stable=True).indices[:, :C]  # foreground first
        used = fg.gather(1, slots)  # (B, C)
        rows = gidx.gather(1, slots).clamp(min=0)
        at = slots.view(B, C, 1, 1).expand(B, C, K, 2)
        with torch.autocast(pred.device.type, enabled=False):
            p = pred.float().permute(0, 2, 1).reshape(B, A, K, D)[..., :2].gather(1, at)
            xy = p + done.anchors[slots][:, :, None]  # (B, C, K, 2) grid units
            sg = sigma.float().permute(0, 2, 1).reshape(B, A, K, 2).gather(1, at)
            gt_k = kpts.gather(1, rows.view(B, C, 1, 1).expand(B, C, K, 3))  # (B, C, K, 3)
            h, w = done.imgsz
            stride = done.strides.view(-1)[slots].view(B, C, 1, 1)
            gt_xy = gt_k[..., :2] * device_values(gt_k, (w, h)) / stride
            sig = sg.sigmoid().clamp_min(torch.finfo(sigma.dtype).tiny)  # its dtype's, as ultralytics
            error = (xy - gt_xy) / (sig + 1e-9)
            valid = (gt_k[..., 2] != 0) & used[..., None] & torch.isfinite(error).all(-1)  # (B, C, K)
            error = torch.where(valid[..., None], error.clamp(-RLE_CLAMP, RLE_CLAMP), 0.0)
            sig = torch.where(valid[..., None], sig, 1.0)
        log_phi = self.flow_model.log_prob(error.reshape(-1, 2)).view(B, C, K)
        with torch.autocast(pred.device.type, enabled=False):
            per = torch.log(sig) - log_phi.float()[..., None] + torch.log(sig * 2) + error.abs()  # (B,C,K,2)
            per = torch.where(valid[..., None], per * self.rle_weights.view(1, 1, K, 1), 0.0)
            return (per.sum() / valid.sum().clamp(min=1)).clamp(min=0)


class FusedE2EPose26Loss(FusedE2ELoss):
    """FusedE2ELoss over FusedPose26Loss: ultralytics' ``E2ELoss(model, PoseLoss26)``, what YOLO26's
    end-to-end pose models train with."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, FusedPose26Loss)


__all__ = ["FusedE2EPose26Loss", "FusedPose26Loss"]
