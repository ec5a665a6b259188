"""ultralytics' ``non_max_suppression`` for a whole batch at once, without host syncs.

For image ``b`` of a ``(B, 4 + nc, A)`` prediction (``xywh`` boxes, then class scores)::

    cand  = (a, c) with score[b, c, a] > conf             multi_label: every class of an anchor
          = (a, argmax_c score[b, c, a]) if its max > conf  otherwise
    order = cand by score descending, ties in (anchor, class) order; the first max_nms kept
    keep  = greedy over order: a candidate is kept unless an earlier kept one of its class (any
            class with ``agnostic``) overlaps it, IoU(xyxy + class * max_wh) > iou_thres
    out   = the first max_det of keep, rows (x1, y1, x2, y2, score, class)

which is ultralytics' result row for row: the boxes are its ``xywh2xyxy`` in the prediction's dtype,
then float32, and the IoU is torchvision's, ``inter / (area_a + area_b - inter)`` in float32 on the
class-offset boxes, each product and sum rounded on its own (the kernel is compiled without fused
multiply-adds), compared as torchvision compares on the device (its CPU kernel with the threshold
in double, its CUDA kernel in float32). The outputs are padded: ``(B, max_det, 6)`` rows and a
per-image count, zeros past it.

Selection runs in torch (a stable sort of the masked scores of every image, so ties keep
ultralytics' candidate order); one Triton program per image then walks its candidates in blocks,
checks each block against the boxes kept so far (at most ``max_det``, so it stops once that many
are kept) and settles the block itself as the fixed point of "kept if no earlier kept candidate of
the block overlaps it", which greedy order reaches in at most a block's length of rounds.

Where results may differ from ultralytics: ultralytics cuts candidates beyond ``max_nms`` with an
unstable sort, so where equal scores straddle the cut, which of them go on is unspecified there
(here: the earliest in candidate order); on the GPU the order of equal scores in torchvision's
sort, and the rounding of its IoU (nvcc may fuse its products into its sums), are its own; and
ultralytics stops and returns no boxes for the remaining images once NMS has taken longer than
its time limit (``2 + 0.05 B`` seconds), which this never does. Extra channels past the class
scores (mask coefficients) are not returned.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from trainfuse._runtime import precompile
from trainfuse._runtime.backend import use_triton

# candidates per round of the kernel: a 64 x 64 overlap tile is 32 values a thread at 4 warps
BLOCK = 64


class BatchedDetections(NamedTuple):
    """A batch's detections: ``rows`` ``(B, max_det, 6)`` float32, ``(x1, y1, x2, y2, conf, cls)``
    in descending confidence, the first ``count[b]`` of image ``b`` real, zeros after; ``count``
    ``(B,)`` int32."""

    rows: torch.Tensor
    count: torch.Tensor

    @property
    def boxes(self) -> torch.Tensor:
        return self.rows[..., :4]

    @property
    def conf(self) -> torch.Tensor:
        return self.rows[..., 4]

    @property
    def cls(self) -> torch.Tensor:
        return self.rows[..., 5]

    def to_list(self) -> list[torch.Tensor]:
        """ultralytics' list of ``(n, 6)`` tensors, one per image (reads the counts: a host sync)."""
        return [r[:n] for r, n in zip(self.rows, self.count.tolist())]


# ---- kernel -------------------------------------------------------------------------------------
@triton.jit
def _offset_box(ptr, offs, m, cls, max_wh):
    """The class-offset box ``xyxy + cls * max_wh`` of rows ``offs`` (4 floats apart) and its area,
    each rounded as torch rounds them (the product cls * max_wh is an exact integer)."""
    c = cls * max_wh
    x1 = tl.load(ptr + offs * 4, mask=m, other=0.0) + c
    y1 = tl.load(ptr + offs * 4 + 1, mask=m, other=0.0) + c
    x2 = tl.load(ptr + offs * 4 + 2, mask=m, other=0.0) + c
    y2 = tl.load(ptr + offs * 4 + 3, mask=m, other=0.0) + c
    return x1, y1, x2, y2, (x2 - x1) * (y2 - y1)


@triton.jit
def _overlaps(ax1, ay1, ax2, ay2, aa, bx1, by1, bx2, by2, ba, thr):
    """torchvision's suppression test: ``inter / (area_a + area_b - inter) > thr`` in float32."""
    w = tl.maximum(tl.minimum(ax2, bx2) - tl.maximum(ax1, bx1), 0.0)
    h = tl.maximum(tl.minimum(ay2, by2) - tl.maximum(ay1, by1), 0.0)
    inter = w * h
    return tl.div_rn(inter, aa + ba - inter) > thr


@triton.jit
def nms_kernel(box_ptr, score_ptr, cls_ptr, n_ptr, out_ptr, count_ptr, K, D, max_wh, thr,
               BLOCK: tl.constexpr):
    """Program ``b``: greedy NMS over image ``b``'s ``n[b]`` candidates (``(B, K)`` rows sorted by
    score; boxes ``(B, K, 4)``), writing the kept rows to ``out`` ``(B, D, 6)`` and their number
    to ``count``. The kept rows in ``out`` are also the boxes later candidates are checked
    against (re-offset as the candidates are, so bit for bit the same)."""
    b = tl.program_id(0)
    n = tl.load(n_ptr + b)
    boxes = box_ptr + b.to(tl.int64) * K * 4
    scores = score_ptr + b.to(tl.int64) * K
    classes = cls_ptr + b.to(tl.int64) * K
    out = out_ptr + b.to(tl.int64) * D * 6
    lane = tl.arange(0, BLOCK)
    kept = n * 0
    start = n * 0
    while (start < n) & (kept < D):
        offs = start + lane
        m = offs < n
        cls = tl.load(classes + offs, mask=m, other=0.0)
        x1, y1, x2, y2, area = _offset_box(boxes, offs, m, cls, max_wh)
        alive = m
        for k0 in range(0, kept, BLOCK):  # against the boxes kept so far
            ko = k0 + lane
            km = ko < kept
            kc = tl.load(out + ko * 6 + 5, mask=km, other=0.0)
            kx1 = tl.load(out + ko * 6, mask=km, other=0.0) + kc * max_wh
            ky1 = tl.load(out + ko * 6 + 1, mask=km, other=0.0) + kc * max_wh
            kx2 = tl.load(out + ko * 6 + 2, mask=km, other=0.0) + kc * max_wh
            ky2 = tl.load(out + ko * 6 + 3, mask=km, other=0.0) + kc * max_wh
            ka = (kx2 - kx1) * (ky2 - ky1)
            hit = _overlaps(x1[:, None], y1[:, None], x2[:, None], y2[:, None], area[:, None],
                            kx1[None, :], ky1[None, :], kx2[None, :], ky2[None, :], ka[None, :], thr)
            alive = alive & (tl.max((hit & km[None, :]).to(tl.int32), 1) == 0)
        # within the block: over[j, i] = an earlier j suppresses i; iterate keep to its fixed point
        over = _overlaps(x1[:, None], y1[:, None], x2[:, None], y2[:, None], area[:, None],
                         x1[None, :], y1[None, :], x2[None, :], y2[None, :], area[None, :], thr)
        over = over & (lane[:, None] < lane[None, :])
        keep = alive
        changed = start >= 0
        while changed:
            new = alive & (tl.max((keep[:, None] & over).to(tl.int32), 0) == 0)
            changed = tl.max((new != keep).to(tl.int32), 0) > 0
            keep = new
        pos = kept + tl.cumsum(keep.to(tl.int32), 0) - 1
        keep = keep & (pos < D)
        row = out + pos * 6
        tl.store(row, tl.load(boxes + offs * 4, mask=keep), mask=keep)
        tl.store(row + 1, tl.load(boxes + offs * 4 + 1, mask=keep), mask=keep)
        tl.store(row + 2, tl.load(boxes + offs * 4 + 2, mask=keep), mask=keep)
        tl.store(row + 3, tl.load(boxes + offs * 4 + 3, mask=keep), mask=keep)
        tl.store(row + 4, tl.load(scores + offs, mask=keep), mask=keep)
        tl.store(row + 5, cls, mask=keep)
        kept += tl.sum(keep.to(tl.int32), 0)
        tl.debug_barrier()  # the next round reads these rows back from other threads
        start += BLOCK
    tl.store(count_ptr + b, kept)


# ---- host side ------------------------------------------------------------------------------------
def iou_threshold(iou_thres: float, device: torch.device) -> float:
    """The float32 ``t`` for which ``iou > t`` decides as torchvision's nms does on ``device``: its
    CUDA kernel compares with ``float32(iou_thres)``, its CPU kernel with the double itself (the
    largest float32 not above it)."""
    near = torch.tensor(iou_thres, dtype=torch.float32)
    if device.type == "cuda" or float(near) <= iou_thres:
        return float(near)
    return float(torch.nextafter(near, torch.tensor(-math.inf)))


def select_candidates(prediction: torch.Tensor, conf_thres: float, nc: int, multi_label: bool,
                      classes: torch.Tensor | None, max_nms: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each image's candidates in NMS order, padded to ``k = min(max_nms, candidates possible)``:
    boxes ``(B, k, 4)`` (``xyxy``, float32), scores ``(B, k)`` (float32, descending), classes
    ``(B, k)`` (float32) and their number ``(B,)`` (int32). Sync-free."""
    from ultralytics.utils.ops import xywh2xyxy

    B, _, A = prediction.shape
    xyxy = xywh2xyxy(prediction[:, :4].transpose(1, 2)).float()  # ultralytics' rounding, in its dtype
    scores = prediction[:, 4:4 + nc]
    if multi_label:
        score = scores.transpose(1, 2).reshape(B, A * nc)
        cls = torch.arange(nc, device=prediction.device).repeat(A).expand(B, -1)
    else:
        score, cls = scores.max(1)
    mask = score > conf_thres  # in the prediction's dtype, as ultralytics compares
    if classes is not None:
        mask &= torch.isin(cls, classes.to(cls.dtype))
    key = torch.where(mask, score.float(), -math.inf)
    # a stable sort: equal scores stay in ultralytics' (anchor, class) candidate order
    key, order = key.sort(dim=1, descending=True, stable=True)
    k = min(max_nms, key.shape[1])
    key, order = key[:, :k].contiguous(), order[:, :k]
    anchor = order // nc if multi_label else order
    boxes = xyxy.gather(1, anchor[..., None].expand(-1, -1, 4)).contiguous()
    cls = cls.gather(1, order).float().contiguous()
    count = mask.sum(1).clamp_(max=k).to(torch.int32)
    return boxes, key, cls, count


def nms_kernels(prediction: torch.Tensor, conf_thres: float, iou_thres: float, classes=None,
                agnostic: bool = False, multi_label: bool = False, max_det: int = 300, nc: int = 0,
                max_nms: int = 30000, max_wh: int = 7680) -> BatchedDetections:
    """:func:`batched_nms` by the kernel (arguments as there)."""
    nc = nc or prediction.shape[1] - 4
    classes = None if classes is None else torch.as_tensor(classes, device=prediction.device)
    boxes, scores, cls, n = select_candidates(prediction, conf_thres, nc, multi_label and nc > 1, classes,
                                              max_nms)
    B, k = scores.shape
    rows = torch.zeros(B, max_det, 6, dtype=torch.float32, device=prediction.device)
    count = torch.zeros(B, dtype=torch.int32, device=prediction.device)
    if k == 0 or max_det == 0 or B == 0:
        return BatchedDetections(rows, count)
    args = (boxes, scores, cls, n, rows, count, k, max_det, 0.0 if agnostic else float(max_wh),
            iou_threshold(iou_thres, prediction.device))
    # torch rounds each product and sum: so must the IoU
    with precompile.first_launch(nms_kernel, args, 4, {"BLOCK": BLOCK}, {"enable_fp_fusion": False}):
        nms_kernel[(B,)](*args, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return BatchedDetections(rows, count)


def pad_detections(outputs: list[torch.Tensor], max_det: int) -> BatchedDetections:
    """ultralytics' per-image ``(n, 6 + extra)`` NMS outputs as :class:`BatchedDetections`."""
    device = outputs[0].device if outputs else torch.device("cpu")
    rows = torch.zeros(len(outputs), max_det, 6, dtype=torch.float32, device=device)
    for row, x in zip(rows, outputs):
        row[:len(x)] = x[:, :6]
    count = torch.tensor([len(x) for x in outputs], dtype=torch.int32, device=device)
    return BatchedDetections(rows, count)


def nms_reference(prediction: torch.Tensor, conf_thres: float, iou_thres: float, classes=None,
                  agnostic: bool = False, multi_label: bool = False, max_det: int = 300, nc: int = 0,
                  max_nms: int = 30000, max_wh: int = 7680) -> BatchedDetections:
    """:func:`batched_nms` by ultralytics' own ``non_max_suppression`` (image by image, syncing),
    padded."""
    from ultralytics.utils.nms import non_max_suppression

    outputs = non_max_suppression(prediction, conf_thres, iou_thres, classes=classes, agnostic=agnostic,
                                  multi_label=multi_label, max_det=max_det, nc=nc, max_nms=max_nms,
                                  max_wh=max_wh)
    return pad_detections(outputs, max_det)


def batched_nms(prediction: torch.Tensor | list | tuple, conf_thres: float = 0.25, iou_thres: float = 0.45,
                classes=None, agnostic: bool = False, multi_label: bool = False, max_det: int = 300,
                nc: int = 0, max_nms: int = 30000, max_wh: int = 7680) -> BatchedDetections:
    """ultralytics' ``non_max_suppression`` for a detection head's output, batched: the Triton
    kernel where :func:`~trainfuse._runtime.backend.use_triton` says so (no host sync), else
    ultralytics' own function, padded. See the module docstring for where they may differ.

    Args:
        prediction: ``(B, 4 + nc + extra, A)`` (``xywh`` boxes, class scores), or a list or tuple
            whose first element is that (a model's validation output).
        conf_thres, iou_thres, classes, agnostic, multi_label, max_det, nc, max_nms, max_wh: as
            ultralytics' ``non_max_suppression`` (``nc`` 0: every channel after the box).

    Returns:
        :class:`BatchedDetections`: ``rows`` ``(B, max_det, 6)`` and ``count`` ``(B,)``.

    Example:
        >>> pred = torch.zeros(1, 6, 3)
        >>> pred[0, :4] = torch.tensor([[5.0, 5.5, 50.0], [5.0, 5.5, 50.0], [4.0, 4.0, 4.0], [4.0, 4.0, 4.0]])
        >>> pred[0, 4:] = torch.tensor([[0.9, 0.8, 0.0], [0.0, 0.1, 0.7]])
        >>> det = batched_nms(pred, 0.05, 0.5, multi_label=True)
        >>> det.count.tolist(), det.conf[0, :3].tolist(), det.cls[0, :3].tolist()
        ([3], [0.8999999761581421, 0.699999988079071, 0.10000000149011612], [0.0, 1.0, 1.0])
    """
    if isinstance(prediction, (list, tuple)):
        prediction = prediction[0]
    if not 0 <= conf_thres <= 1 or not 0 <= iou_thres <= 1:
        raise ValueError(f"batched_nms: conf_thres and iou_thres must be in [0, 1], got {conf_thres} and "
                         f"{iou_thres}")
    run = nms_kernels if use_triton(prediction.device) else nms_reference
    return run(prediction, conf_thres, iou_thres, classes=classes, agnostic=agnostic, multi_label=multi_label,
               max_det=max_det, nc=nc, max_nms=max_nms, max_wh=max_wh)


__all__ = ["BatchedDetections", "batched_nms", "iou_threshold", "nms_kernels", "nms_reference",
           "pad_detections", "select_candidates"]
