"""ultralytics' matching of detections to labels (``BaseValidator.match_predictions``, its greedy
branch) for a whole batch, without host syncs.

For image ``b``, detection ``j`` in descending confidence and IoU threshold ``t``::

    iou[j, l]     = box_iou(label_l, det_j) if cls_l == cls_j else 0     (labels l < nlabels[b])
    avail[l]      = 0 if l is claimed at t else iou[j, l]
    k             = argmax_l avail[l]           (the first of equal values)
    tp[j, t]      = avail[k] >= threshold_t;    then k is claimed at t where tp[j, t]

The IoU is ultralytics' ``box_iou`` (eps 1e-7) op for op, in torch, on the padded batch
(:func:`true_positives`); the matching itself is one Triton program per image, sequential over its
detections with the claimed (label x threshold) table in registers (:func:`match_kernels`), or,
without Triton, the same recurrence vectorized over images in torch (:func:`match_torch`). Both
give ultralytics' ``tp`` exactly, for the detections in the order they are given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainfuse._runtime import precompile
from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.launch import next_power_of_2


# ---- kernel -------------------------------------------------------------------------------------
@triton.jit
def match_kernel(iou_ptr, nlabels_ptr, count_ptr, thr_ptr, tp_ptr, M, D, T, M_PAD: tl.constexpr,
                 T_PAD: tl.constexpr):
    """Program ``b``: ``tp[b, j, t]`` (int8, ``(B, D, T)``) for image ``b``'s ``count[b]``
    detections against its ``nlabels[b]`` labels, from ``iou`` ``(B, D, M)`` (zero across
    classes). Padding labels hold -1, below any unclaimed label, so never the first maximum;
    padding thresholds are infinite, so never reached."""
    b = tl.program_id(0)
    nl = tl.load(nlabels_ptr + b)
    n = tl.load(count_ptr + b)
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, T_PAD)
    thr = tl.load(thr_ptr + cols, mask=cols < T, other=float("inf"))
    claimed = (rows[:, None] < 0) & (cols[None, :] < 0)
    iou = iou_ptr + b.to(tl.int64) * D * M
    tp = tp_ptr + b.to(tl.int64) * D * T
    for j in range(n):
        col = tl.load(iou + j * M + rows, mask=rows < nl, other=-1.0)
        avail = tl.where(claimed, 0.0, col[:, None])
        k = tl.argmax(avail, 0, tie_break_left=True)
        correct = tl.max(avail, 0) >= thr
        claimed = claimed | ((rows[:, None] == k[None, :]) & correct[None, :])
        tl.store(tp + j * T + cols, correct.to(tl.int8), mask=cols < T)


def match_kernels(iou: torch.Tensor, nlabels: torch.Tensor, count: torch.Tensor,
                  thresholds: torch.Tensor) -> torch.Tensor:
    """:func:`match_detections` by the kernel (arguments as there)."""
    B, D, M = iou.shape
    T = thresholds.numel()
    tp = torch.zeros(B, D, T, dtype=torch.int8, device=iou.device)
    if B == 0 or D == 0 or M == 0 or T == 0:
        return tp.bool()
    m_pad = next_power_of_2(M)
    t_pad = next_power_of_2(T)
    # the claimed table and a column of it per register: ~32 values a thread
    warps = min(16, max(1, m_pad * t_pad // 1024))
    thresholds = thresholds.to(iou.device, torch.float32).contiguous()
    args = (iou.float().contiguous(), nlabels.to(torch.int32).contiguous(),
            count.to(torch.int32).contiguous(), thresholds, tp, M, D, T)
    with precompile.first_launch(match_kernel, args, warps, {"M_PAD": m_pad, "T_PAD": t_pad}):
        match_kernel[(B,)](*args, M_PAD=m_pad, T_PAD=t_pad, num_warps=warps)
    return tp.view(torch.bool)


def match_torch(iou: torch.Tensor, nlabels: torch.Tensor, count: torch.Tensor,
                thresholds: torch.Tensor) -> torch.Tensor:
    """:func:`match_detections` in torch: the recurrence over the detection rank, every image at
    once (reads the largest count: a host sync on a GPU)."""
    B, D, M = iou.shape
    T = thresholds.numel()
    tp = torch.zeros(B, D, T, dtype=torch.bool, device=iou.device)
    if B == 0 or D == 0 or M == 0 or T == 0:
        return tp
    labels = torch.arange(M, device=iou.device)
    iou = torch.where(labels < nlabels.reshape(B, 1, 1), iou.float(), -1.0)
    thresholds = thresholds.to(iou.device, torch.float32)
    claimed = torch.zeros(B, M, T, dtype=torch.bool, device=iou.device)
    for j in range(int(count.max())):
        avail = torch.where(claimed, 0.0, iou[:, j, :, None])
        k = avail.argmax(1, keepdim=True)  # the first of equal values
        correct = (avail.gather(1, k).squeeze(1) >= thresholds) & (j < count).reshape(B, 1)
        claimed.scatter_(1, k, claimed.gather(1, k) | correct[:, None])
        tp[:, j] = correct
    return tp


def match_detections(iou: torch.Tensor, nlabels: torch.Tensor, count: torch.Tensor,
                     thresholds: torch.Tensor) -> torch.Tensor:
    """ultralytics' greedy ``match_predictions`` for a batch: the kernel where
    :func:`~trainfuse._runtime.backend.use_triton` says so, else :func:`match_torch`.

    Args:
        iou: ``(B, D, M)``: detection ``j``'s IoU with label ``l`` of image ``b``, zero where
            their classes differ; detections in descending confidence.
        nlabels: ``(B,)`` labels per image (the first ``nlabels[b]`` of the ``M`` are real).
        count: ``(B,)`` detections per image (the first ``count[b]`` of the ``D`` are real).
        thresholds: ``(T,)`` IoU thresholds (float32), ultralytics' ``iouv``.

    Returns:
        ``tp`` ``(B, D, T)`` bool, False past each image's count.

    Example:
        >>> iou = torch.tensor([[[0.9, 0.6], [0.8, 0.0]]])  # 2 detections x 2 labels
        >>> match_detections(iou, torch.tensor([2]), torch.tensor([2]), torch.tensor([0.5, 0.85]))[0].tolist()
        [[True, True], [False, False]]
    """
    run = match_kernels if use_triton(iou.device) else match_torch
    return run(iou, nlabels, count, thresholds)


# ---- the IoU, as ultralytics computes it --------------------------------------------------------
def label_boxes(padded: torch.Tensor, imgsz: tuple[int, int]) -> torch.Tensor:
    """``(B, M, 4)`` pixel ``xyxy`` boxes of padded labels ``(B, M, 5)`` (class, normalized
    ``xywh``), as the validator's ``_prepare_batch`` scales them op for op (``xywh2xyxy``, then
    times ``(w, h, w, h)``); the sizes multiply as Python numbers, so nothing is copied from the
    host."""
    from ultralytics.utils.ops import xywh2xyxy

    h, w = int(imgsz[0]), int(imgsz[1])
    boxes = xywh2xyxy(padded[..., 1:5].float())
    boxes[..., 0::2] *= w
    boxes[..., 1::2] *= h
    return boxes


def batched_box_iou(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """ultralytics' ``box_iou`` with a batch dimension, op for op: ``(B, N, 4)`` and ``(B, M, 4)``
    ``xyxy`` boxes give ``(B, N, M)``."""
    (a1, a2), (b1, b2) = box1.float().unsqueeze(2).chunk(2, 3), box2.float().unsqueeze(1).chunk(2, 3)
    wh, wh1, wh2 = (torch.min(a2, b2) - torch.max(a1, b1)).clamp_(0), a2 - a1, b2 - b1
    inter = wh[..., 0] * wh[..., 1]
    return inter / (wh1[..., 0] * wh1[..., 1] + wh2[..., 0] * wh2[..., 1] - inter + eps)


def true_positives(boxes: torch.Tensor, cls: torch.Tensor, count: torch.Tensor, padded: torch.Tensor,
                   nlabels: torch.Tensor, imgsz: tuple[int, int], thresholds: torch.Tensor) -> torch.Tensor:
    """The validator's ``tp`` for a batch: detections ``boxes`` ``(B, D, 4)`` and ``cls``
    ``(B, D)`` (the first ``count[b]`` real) against padded labels ``(B, M, 5)`` (the first
    ``nlabels[b]`` real) in an image of ``imgsz = (h, w)`` pixels. ``(B, D, T)`` bool."""
    labels = label_boxes(padded, imgsz)
    iou = batched_box_iou(labels, boxes)  # (B, M, D): ultralytics' operand order
    iou = iou * (padded[..., 0, None] == cls[:, None, :])
    return match_detections(iou.transpose(1, 2).contiguous(), nlabels, count, thresholds)


__all__ = ["batched_box_iou", "label_boxes", "match_detections", "match_kernels", "match_torch",
           "true_positives"]
