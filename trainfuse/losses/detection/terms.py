"""The detection loss's three terms (box, class, DFL or L1) over an assignment: the autograd
Function on the kernels (forward two launches, backward two) and the dense torch reference.

``terms * batch`` with the gains applied is ultralytics' ``v8DetectionLoss`` result; the kernels'
math is in ``box_loss.py`` and ``cls_loss.py``, the assignment in ``assigner.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from trainfuse._runtime.function import applier
from trainfuse.losses.detection import box_loss
from trainfuse.losses.detection.assigner import Assignment, decode, distances
from trainfuse.losses.detection.box_loss import CIOU_EPS, box_loss_bwd_kernel, box_loss_fwd_kernel
from trainfuse.losses.detection.cls_loss import cls_loss_bwd_kernel, cls_loss_fwd_kernel, cls_tiles
from trainfuse.losses.detection.sums import blocks, launcher, persistent_grid, scratch
from trainfuse.losses.detection.targets import device_values, label_pixels
from trainfuse.losses.iou import bbox_iou_reference


class LossConstants(NamedTuple):
    """What the loss kernels take besides tensors: the image size in pixels, the gains, the batch
    size (the result is ``terms * batch``) and the DFL target's upper bound ``reg_max - 1.01``
    (unused without DFL)."""

    height: float
    width: float
    gains: tuple[float, float, float]
    batch: float
    dfl_hi: float


class DetectionLossFunction(torch.autograd.Function):
    """The loss terms on the kernels: forward two launches (box+DFL or box+L1, BCE) writing ``out``
    (the terms times the batch size) and ``items`` (the terms), backward two (the grads of the box
    outputs and of the class logits)."""

    @staticmethod
    def forward(ctx, boxes, scores, asg: Assignment, gt, anchors, strides, class_weights, k: LossConstants):
        B, C, A = boxes.shape
        dev = boxes.device
        out = torch.empty(3, dtype=torch.float32, device=dev)
        items = torch.empty(3, dtype=torch.float32, device=dev)
        nblk = B * -(-A // blocks.box)
        partials, counter = scratch(dev, 2 * nblk)
        launcher(box_loss_fwd_kernel, (nblk,), boxes, asg.gidx, asg.t, gt, anchors, strides, asg.tss, out,
                 items, partials, counter, A, gt.shape[1], k.width, k.height, nblk, k.dfl_hi, CIOU_EPS,
                 k.gains[0], k.gains[2], k.batch, R=C // 4, BLOCK=blocks.box, num_warps=4)
        nc = scores.shape[1]
        tiles, nab = cls_tiles(B, nc, A, blocks.cls)
        grid = persistent_grid(dev, tiles)
        w = class_weights if class_weights is not None else scores
        partials, counter = scratch(dev, grid)
        launcher(cls_loss_fwd_kernel, (grid,), scores, asg.label, asg.t, w, asg.tss, out, items, partials,
                 counter, tiles, nab, A, nc, k.gains[1], k.batch, HAS_W=class_weights is not None,
                 BLOCK=blocks.cls, num_warps=4)
        ctx.save_for_backward(boxes, scores, asg.gidx, asg.label, asg.t, asg.tss, gt, anchors, strides, w)
        ctx.constants, ctx.has_w = k, class_weights is not None
        ctx.mark_non_differentiable(items)
        ctx.set_materialize_grads(False)  # items' grad would be a zero-filled tensor: a launch per step
        return out, items

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go, _):
        boxes, scores, gidx, label, t, tss, gt, anchors, strides, w = ctx.saved_tensors
        k = ctx.constants
        B, C, A = boxes.shape
        g_boxes = g_scores = None
        if go is None:  # only items reached the loss: no grad flows
            return g_boxes, g_scores, None, None, None, None, None, None
        if ctx.needs_input_grad[0]:
            g_boxes = torch.empty_like(boxes)
            launcher(box_loss_bwd_kernel, (B * -(-A // blocks.box),), boxes, g_boxes, gidx, t, gt, anchors,
                     strides, tss, go, go.stride(0), A, gt.shape[1], k.width, k.height, k.dfl_hi, CIOU_EPS,
                     k.gains[0], k.gains[2], k.batch, R=C // 4, BLOCK=blocks.box,
                     RECOMPUTE=box_loss.RECOMPUTE_SOFTMAX and C > 4, num_warps=4)
        if ctx.needs_input_grad[1]:
            g_scores = torch.empty_like(scores)
            nc = scores.shape[1]
            tiles, nab = cls_tiles(B, nc, A, blocks.cls)
            launcher(cls_loss_bwd_kernel, (persistent_grid(scores.device, tiles),), scores, label, t, w, tss,
                     go, go.stride(0), g_scores, tiles, nab, A, nc, k.gains[1], k.batch, HAS_W=ctx.has_w,
                     BLOCK=blocks.cls, num_warps=4)
        return g_boxes, g_scores, None, None, None, None, None, None


apply_detection_loss = applier(DetectionLossFunction)


def loss_terms_torch(boxes, scores, asg: Assignment, gt, imgsz, anchors, strides, class_weights
                     ) -> torch.Tensor:
    """The three terms (before gains) as dense, masked torch operations: the CPU path and the
    kernels' reference. ``(3,)``: box, cls, dfl (l1 for ``reg_max = 1``) (float32, or float64
    from float64 inputs)."""
    B, C, A = boxes.shape
    R = C // 4
    ct = torch.promote_types(boxes.dtype, torch.float32)  # float32, or float64 for a float64 reference
    fg = asg.gidx >= 0
    gidx = asg.gidx.clamp(0).long()[..., None].expand(B, A, 4)
    target = label_pixels(gt, imgsz).gather(1, gidx) / strides[:, None]
    pred = decode(boxes, anchors)
    iou = bbox_iou_reference(pred, target, xywh=False, CIoU=True).squeeze(-1)
    box = torch.where(fg, (1.0 - iou) * asg.t, 0.0).sum() / asg.tss
    y = torch.cat((anchors - target[..., :2], target[..., 2:] - anchors), -1)
    if R == 1:
        # ultralytics' L1: the ltrb distances in pixels over the image's (w, h, w, h)
        size = device_values(strides, (imgsz[1], imgsz[0], imgsz[1], imgsz[0]))
        s = strides[:, None]
        l1 = (distances(boxes) * s / size - y * s / size).abs().mean(-1)
        third = torch.where(fg, l1 * asg.t, 0.0).sum() / asg.tss
    else:
        third = _dfl_term(boxes.to(ct).view(B, 4, R, A), y.clamp(0, R - 1 - 0.01), fg, asg)
    onehot = torch.zeros(B, scores.shape[1] + 1, A, dtype=asg.t.dtype, device=scores.device)
    onehot.scatter_(1, (asg.label.long() + 1)[:, None], asg.t[:, None])  # row 0: background
    bce = torch.nn.functional.binary_cross_entropy_with_logits(scores.to(ct), onehot[:, 1:], reduction="none")
    if class_weights is not None:
        bce = bce * class_weights.view(1, -1, 1)
    return torch.stack((box, bce.sum() / asg.tss, third))


def _dfl_term(logits: torch.Tensor, y: torch.Tensor, fg: torch.Tensor, asg: Assignment) -> torch.Tensor:
    """The DFL term of :func:`loss_terms_torch`: logits ``(B, 4, R, A)``, clamped targets ``y``
    ``(B, A, 4)``."""
    lo = y.long()
    wl = (lo + 1) - y
    logp = logits.log_softmax(2)
    lo = lo.transpose(1, 2)[:, :, None]  # (B, 4, 1, A)
    pick = logp.gather(2, lo).squeeze(2) * wl.transpose(1, 2) + logp.gather(2, lo + 1).squeeze(2) * (
        1 - wl.transpose(1, 2))
    return torch.where(fg, -pick.mean(1) * asg.t, 0.0).sum() / asg.tss


__all__ = ["DetectionLossFunction", "LossConstants", "apply_detection_loss", "loss_terms_torch"]
