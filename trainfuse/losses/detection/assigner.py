"""ultralytics' TaskAlignedAssigner without host syncs or data-dependent shapes.

For image ``b``, ground truth ``g`` (padded to a fixed capacity ``M``; a padding row has a zero
box) and anchor ``a`` (centre in pixels)::

    cand   = a inside g's box (sides below stride_val widened to it), g not padding
    ov     = clamp(CIoU(gt_g, pred_a), 0)                    on cand, else 0
    align  = sigmoid(score[b, label_g, a])^alpha ov^beta     on cand, else 0
    pos    = a among the top-k anchors of g by align, and cand
    gidx_a = the g with pos, or where several, the g of largest ov (first on ties); -1: none
    gidx_a = -1 where a is not among g's top-k2 positives by align  (only if topk2 != topk)
    t_a    = align[gidx, a] * max_a' ov[gidx, a'] / (max_a' align[gidx, a'] + eps)
             (maxima over g's positives)                    0 on background
    tss    = max(sum t, 1)

which is ultralytics' assignment, its ``(B, A, nc)`` target scores being ``t`` at ``label[gidx]``.
The predicted box is the DFL decode of the box logits, or for a head without DFL (``reg_max = 1``,
YOLO26) the box outputs themselves as distances.

Four launches on a GPU: ``metric`` (per anchor block: the decode of the predicted box, then
over the ground truths the in-box test, the CIoU, the score gather and the metric), ``topk`` (a
row of anchors per program: k rounds of argmax), ``resolve`` (positives, the multi-assignment
fix, the per-gt maxima by float atomic max, which is order-free) and ``scores`` (t, labels and
``tss`` in one launch). The capacity ``M`` changes as a run's batches do (a power of two: 16, then
8 after mosaic closes), and only ever scales row indices, so the kernels that take it do not
specialize on it: one compile serves every capacity. A second k (``topk2 != topk``: the
one-to-one branch of YOLOv10 and YOLO26 trains with 7 and 1) adds ``topk2`` between the last two:
a ground truth's row per program, k2 rounds of argmax over its positives, which drops the others
and writes the maxima anew. The torch path (CPU) runs the same math densely.

Ties: where several anchors of a ground truth share the k-th largest metric, the top-k kernel
keeps the lowest anchor indices; ultralytics (and the torch path) keep whichever ``torch.topk``
returns, which is unspecified. With float predictions such ties are metrics of exactly 0 (a
ground truth with fewer than k anchors of positive metric). A pick of metric 0 gets ``t = 0``,
so it adds nothing to any loss term, except where it makes an anchor positive for a second
ground truth: then the largest-overlap rule may hand the anchor to another one. Where that
argmax meets equal overlaps, ultralytics and the kernels both take the first ground truth. The
second k ranks a ground truth's positives only (ultralytics ranks the row with zeros elsewhere):
the two differ only in which positives of metric 0 stay positive, and those have ``t = 0``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from trainfuse._runtime.launch import cdiv, next_power_of_2
from trainfuse._runtime.reduce import last_to_arrive
from trainfuse.losses.box_math import ciou_xyxy
from trainfuse.losses.detection.box_loss import CIOU_EPS, label_box, side_distance
from trainfuse.losses.detection.sums import arrive, blocks, gather_sum, launcher, scratch
from trainfuse.losses.detection.targets import label_pixels
from trainfuse.losses.iou import bbox_iou_reference


class Assignment(NamedTuple):
    """Per anchor: ``gidx`` (int32, -1 on background), ``label`` (int32, -1 on background), the
    target score ``t`` (float32); and ``tss``, ``max(sum t, 1)`` (float32, 0-d)."""

    gidx: torch.Tensor
    label: torch.Tensor
    t: torch.Tensor
    tss: torch.Tensor


class AssignConfig(NamedTuple):
    topk: int = 10
    topk2: int = 10
    alpha: float = 0.5
    beta: float = 6.0
    stride_val: float = 16.0
    eps: float = 1e-9


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _pow(x, P: tl.constexpr, N: tl.constexpr):
    """x ** P for x >= 0: the exact sqrt for P = 0.5, N - 1 products where P is the integer N
    (``power_steps``), else exp2(P log2 x)."""
    if P == 0.5:
        return tl.sqrt_rn(x)
    elif N > 0:
        y = x
        for _ in tl.static_range(N - 1):
            y = y * x
        return y
    else:
        return tl.where(x > 0, tl.exp2(P * tl.log2(x)), 0.0)


def power_steps(p: float) -> int:
    """N where ``x ** p`` is N - 1 products (p a whole number in 1..8), else 0."""
    return int(p) if p == int(p) and 1 <= p <= 8 else 0


@triton.jit(do_not_specialize=["M"])
def metric_kernel(boxes, scores, gt_ptr, anc_ptr, stride_ptr, align_ptr, ov_ptr, cand_ptr, pos_align, pos_ov,
                  A, M, NC, W, H, stride_val, eps, ciou_eps, R: tl.constexpr, ALPHA: tl.constexpr,
                  ALPHA_N: tl.constexpr, BETA: tl.constexpr, BETA_N: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``b * cdiv(A, BLOCK) + block``: decode the block's predicted boxes once (``R``:
    reg_max), then for every ground truth of image ``b`` write ``align``, ``ov`` and ``cand``
    (``(B, M, A)``); block 0 zeroes the per-gt maxima that :func:`resolve_kernel` accumulates."""
    nblk = tl.cdiv(A, BLOCK)
    b = tl.program_id(0) // nblk
    blk = tl.program_id(0) % nblk
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    am = offs < A
    base = boxes + b.to(tl.int64) * (4 * R) * A
    d0 = side_distance(base, 0, offs, am, A, R)
    d1 = side_distance(base, 1, offs, am, A, R)
    d2 = side_distance(base, 2, offs, am, A, R)
    d3 = side_distance(base, 3, offs, am, A, R)
    s = tl.load(stride_ptr + offs, mask=am, other=1.0)
    ax = tl.load(anc_ptr + offs * 2, mask=am, other=0.0)
    ay = tl.load(anc_ptr + offs * 2 + 1, mask=am, other=0.0)
    px1 = (ax - d0) * s
    py1 = (ay - d1) * s
    px2 = (ax + d2) * s
    py2 = (ay + d3) * s
    cx = ax * s
    cy = ay * s
    sc_base = scores + b.to(tl.int64) * NC * A
    for g in range(M):
        row = gt_ptr + (b * M + g) * 5 + tl.zeros([BLOCK], tl.int32)  # one row, loaded as a block
        label = tl.load(row, mask=am, other=0.0).to(tl.int32)
        x1, y1, x2, y2 = label_box(row, am, W, H)
        valid = x1 + y1 + x2 + y2 > 0
        # ultralytics widens sides below stride_val about the centre (xyxy -> xywh -> xyxy)
        mx = (x1 + x2) / 2
        my = (y1 + y2) / 2
        w = x2 - x1
        h = y2 - y1
        w = tl.where(valid & (w < stride_val), stride_val, w) / 2
        h = tl.where(valid & (h < stride_val), stride_val, h) / 2
        inb = (cx - (mx - w) > eps) & (cy - (my - h) > eps) & ((mx + w) - cx > eps) & ((my + h) - cy > eps)
        cand = inb & valid & am
        val = ciou_xyxy(x1, y1, x2, y2, px1, py1, px2, py2, ciou_eps)[0]
        ov = tl.where(cand, tl.maximum(val, 0.0), 0.0)
        x = tl.load(sc_base + label * A + offs, mask=cand, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-x))
        align = tl.where(cand, _pow(sig, ALPHA, ALPHA_N) * _pow(ov, BETA, BETA_N), 0.0)
        out = (b * M + g).to(tl.int64) * A + offs
        tl.store(align_ptr + out, align, mask=am)
        tl.store(ov_ptr + out, ov, mask=am)
        tl.store(cand_ptr + out, cand.to(tl.int8), mask=am)
        if blk == 0:
            tl.store(pos_align + b * M + g, 0.0)
            tl.store(pos_ov + b * M + g, 0.0)


@triton.jit
def topk_kernel(align_ptr, sel_ptr, A, K: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``row``: 1 at the ``K`` largest metrics of the row, 0 elsewhere (int8). K rounds of
    an argmax over the whole row in registers; equal metrics go to the lowest anchor index."""
    row = tl.program_id(0).to(tl.int64) * A
    offs = tl.arange(0, BLOCK)
    m = offs < A
    v = tl.load(align_ptr + row + offs, mask=m, other=-1.0)  # metrics are >= 0: padding is never taken
    sel = offs < 0
    for _ in tl.static_range(K):
        hit = offs == tl.argmax(v, 0, tie_break_left=True)
        sel = sel | hit
        v = tl.where(hit, -2.0, v)
    tl.store(sel_ptr + row + offs, sel.to(tl.int8), mask=m)


@triton.jit(do_not_specialize=["M"])
def resolve_kernel(sel_ptr, cand_ptr, align_ptr, ov_ptr, gidx_ptr, pos_align, pos_ov, A, M,
                   BLOCK: tl.constexpr):
    """Program ``b * cdiv(A, BLOCK) + block``: each anchor's ground truth (or -1), and the per-gt
    maxima of the positives' metric and overlap (float atomic max: order-free, so deterministic)."""
    nblk = tl.cdiv(A, BLOCK)
    b = tl.program_id(0) // nblk
    offs = (tl.program_id(0) % nblk) * BLOCK + tl.arange(0, BLOCK)
    am = offs < A
    count = tl.zeros([BLOCK], tl.int32)
    first = tl.full([BLOCK], -1, tl.int32)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_g = tl.zeros([BLOCK], tl.int32)
    for g in range(M):
        at = (b * M + g).to(tl.int64) * A + offs
        pos = (tl.load(sel_ptr + at, mask=am, other=0) != 0) & (tl.load(cand_ptr + at, mask=am, other=0) != 0)
        ov = tl.load(ov_ptr + at, mask=am, other=0.0)
        count += pos.to(tl.int32)
        first = tl.where(pos & (first < 0), g, first)
        better = ov > best  # strict: the first of equal overlaps wins, as torch's max
        best = tl.where(better, ov, best)
        best_g = tl.where(better, g, best_g)
    gidx = tl.where(count > 1, best_g, first)
    fg = gidx >= 0
    at = (b * M + gidx).to(tl.int64) * A + offs
    tl.atomic_max(pos_align + b * M + gidx, tl.load(align_ptr + at, mask=fg, other=0.0), mask=fg)
    tl.atomic_max(pos_ov + b * M + gidx, tl.load(ov_ptr + at, mask=fg, other=0.0), mask=fg)
    tl.store(gidx_ptr + b * A + offs, gidx, mask=am)


@triton.jit(do_not_specialize=["M"])
def topk2_kernel(gidx_ptr, align_ptr, ov_ptr, pos_align, pos_ov, A, M, K: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``row = b * M + g``: of the anchors assigned to ``g``, keep the ``K`` of largest
    metric (the lowest anchor index on ties), set the others' ``gidx`` to -1, and write ``g``'s
    maxima of the metric and overlap over those kept. Each program writes only anchors assigned to
    its own ``g``, so a concurrent read by another row's program sees -1 or ``g``: neither is its
    own, so the result does not depend on the order."""
    row = tl.program_id(0)
    b = row // M
    g = row % M
    offs = tl.arange(0, BLOCK)
    m = offs < A
    at = row.to(tl.int64) * A + offs
    mine = tl.load(gidx_ptr + b * A + offs, mask=m, other=-1) == g
    align = tl.load(align_ptr + at, mask=mine, other=0.0)
    v = tl.where(mine, align, -1.0)  # metrics are >= 0: another gt's anchor is never taken first
    kept = offs < 0
    for _ in tl.static_range(K):
        hit = offs == tl.argmax(v, 0, tie_break_left=True)
        kept = kept | hit
        v = tl.where(hit, -2.0, v)
    kept = kept & mine
    tl.store(gidx_ptr + b * A + offs, tl.full([BLOCK], -1, tl.int32), mask=mine & ~kept)
    tl.store(pos_align + row, tl.max(tl.where(kept, align, 0.0), 0))
    tl.store(pos_ov + row, tl.max(tl.where(kept, tl.load(ov_ptr + at, mask=kept, other=0.0), 0.0), 0))


@triton.jit(do_not_specialize=["M"])
def scores_kernel(gidx_ptr, align_ptr, pos_align, pos_ov, gt_ptr, t_ptr, label_ptr, tss_ptr, partials,
                  counter, A, M, n, eps, BLOCK: tl.constexpr):
    """Per anchor: ``t`` and the label; the last program writes ``tss = max(sum t, 1)``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    gidx = tl.load(gidx_ptr + offs, mask=m, other=-1)
    fg = gidx >= 0
    b = offs // A
    bg = b * M + gidx
    align = tl.load(align_ptr + bg.to(tl.int64) * A + offs % A, mask=fg, other=0.0)
    po = tl.load(pos_ov + bg, mask=fg, other=0.0)
    pa = tl.load(pos_align + bg, mask=fg, other=0.0)
    t = tl.where(fg, align * po / (pa + eps), 0.0)
    label = tl.where(fg, tl.maximum(tl.load(gt_ptr + bg * 5, mask=fg, other=0.0).to(tl.int32), 0), -1)
    tl.store(t_ptr + offs, t, mask=m)
    tl.store(label_ptr + offs, label, mask=m)
    nprog = tl.num_programs(0)
    arrive(partials, nprog, 0, tl.sum(t, 0))
    if last_to_arrive(counter, nprog):
        tl.store(tss_ptr, tl.maximum(gather_sum(partials, nprog, 0), 1.0).to(tl.float32))
        tl.store(counter, 0)


def metric(boxes, scores, gt, imgsz, anchors, strides, cfg: AssignConfig):
    """The first kernel: ``(align, ov, cand, pos_align, pos_ov)``."""
    B, _, A = scores.shape
    M = gt.shape[1]
    R = boxes.shape[1] // 4
    dev = scores.device
    align = torch.empty(B, M, A, dtype=torch.float32, device=dev)
    ov = torch.empty(B, M, A, dtype=torch.float32, device=dev)
    cand = torch.empty(B, M, A, dtype=torch.int8, device=dev)
    pos = torch.empty(2, B, M, dtype=torch.float32, device=dev)
    launcher(metric_kernel, (B * cdiv(A, blocks.assign),), boxes, scores, gt, anchors, strides, align,
             ov, cand, pos[0], pos[1], A, M, scores.shape[1], float(imgsz[1]), float(imgsz[0]),
             float(cfg.stride_val), float(cfg.eps), CIOU_EPS,
             R=R, ALPHA=float(cfg.alpha), ALPHA_N=power_steps(cfg.alpha), BETA=float(cfg.beta),
             BETA_N=power_steps(cfg.beta), BLOCK=blocks.assign, num_warps=4)
    return align, ov, cand, pos[0], pos[1]


TOPK_ROW_MAX = 16384  # anchors a top-k program holds in registers (16 warps: 32 a thread); 1280 px is 33,600


def topk_mask_torch(align: torch.Tensor, k: int) -> torch.Tensor:
    """int8 ``(B, M, A)``: 1 at each row's top ``k`` (``torch.topk``'s choice on ties, as in
    ultralytics)."""
    idx = torch.topk(align, k, dim=-1).indices
    return torch.zeros(align.shape, dtype=torch.int8, device=align.device).scatter_(-1, idx, 1)


def topk_mask(align: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_mask_torch` in one launch (lowest anchor index first on ties), for rows of up
    to ``TOPK_ROW_MAX`` anchors; longer rows take torch.topk."""
    B, M, A = align.shape
    block = next_power_of_2(A)
    if block > TOPK_ROW_MAX or k > A:
        return topk_mask_torch(align, k)
    sel = torch.empty(align.shape, dtype=torch.int8, device=align.device)
    launcher(topk_kernel, (B * M,), align, sel, A, K=k, BLOCK=block, num_warps=16 if block >= 8192 else 4)
    return sel


def keep_topk2_torch(gidx: torch.Tensor, align: torch.Tensor, k: int) -> torch.Tensor:
    """``gidx`` (``(B, A)``, -1 on background) with each ground truth's positives outside its top
    ``k`` by ``align`` (``(B, M, A)``) set to -1: ultralytics' second k, ``torch.topk``'s choice on
    ties."""
    M = align.shape[1]
    one = gidx[:, None] == torch.arange(M, device=gidx.device).view(1, M, 1)
    kept = torch.topk(align * one, k, dim=-1).indices
    one &= torch.zeros_like(one).scatter_(-1, kept, True)
    return torch.where(one.any(1), gidx, -1)


def keep_topk2(gidx, align, ov, pos_align, pos_ov, k: int) -> None:
    """The second k in place on the kernels' ``gidx`` and per-gt maxima (one launch; rows of more
    than ``TOPK_ROW_MAX`` anchors, or ``k`` above the anchors, take :func:`keep_topk2_torch`)."""
    B, M, A = align.shape
    block = next_power_of_2(A)
    if block > TOPK_ROW_MAX or k > A:
        gidx.copy_(keep_topk2_torch(gidx, align, k))
        one = gidx[:, None] == torch.arange(M, device=gidx.device).view(1, M, 1)
        torch.amax(align * one, -1, out=pos_align)
        torch.amax(ov * one, -1, out=pos_ov)
        return
    launcher(topk2_kernel, (B * M,), gidx, align, ov, pos_align, pos_ov, A, M, K=k, BLOCK=block,
             num_warps=16 if block >= 8192 else 4)


def resolve(sel, cand, align, ov, pos_align, pos_ov) -> torch.Tensor:
    B, M, A = align.shape
    gidx = torch.empty(B, A, dtype=torch.int32, device=align.device)
    launcher(resolve_kernel, (B * cdiv(A, blocks.assign),), sel, cand, align, ov, gidx, pos_align,
             pos_ov, A, M, BLOCK=blocks.assign, num_warps=4)
    return gidx


def target_scores(gidx, align, pos_align, pos_ov, gt, cfg: AssignConfig) -> Assignment:
    B, M, A = align.shape
    n = B * A
    dev = align.device
    t = torch.empty(B, A, dtype=torch.float32, device=dev)
    label = torch.empty(B, A, dtype=torch.int32, device=dev)
    tss = torch.empty((), dtype=torch.float32, device=dev)
    block = blocks.scores
    grid = cdiv(n, block)
    partials, counter = scratch(dev, grid)
    launcher(scores_kernel, (grid,), gidx, align, pos_align, pos_ov, gt, t, label, tss, partials, counter,
             A, M, n, float(cfg.eps), BLOCK=block, num_warps=4)
    return Assignment(gidx, label, t, tss)


def assign_kernels(boxes, scores, gt, imgsz, anchors, strides, cfg: AssignConfig) -> Assignment:
    """The assignment on the kernels (see the module docstring): contiguous inputs, ``gt`` the
    padded labels ``(B, M, 5)`` (class and normalized ``xywh``, float32), ``imgsz`` the image's
    ``(h, w)`` in pixels, ``anchors`` ``(A, 2)`` and ``strides`` ``(A,)`` (float32, grid units)."""
    align, ov, cand, pos_align, pos_ov = metric(boxes, scores, gt, imgsz, anchors, strides, cfg)
    sel = topk_mask(align, cfg.topk)
    gidx = resolve(sel, cand, align, ov, pos_align, pos_ov)
    if cfg.topk2 != cfg.topk:
        keep_topk2(gidx, align, ov, pos_align, pos_ov, cfg.topk2)
    return target_scores(gidx, align, pos_align, pos_ov, gt, cfg)


# ---- torch ----------------------------------------------------------------------------------------
def distances(boxes: torch.Tensor) -> torch.Tensor:
    """The ``(B, A, 4)`` predicted ltrb distances in grid units of the ``(B, 4R, A)`` box outputs:
    the DFL expectation, or for ``R = 1`` the outputs themselves (differentiable)."""
    B, C, A = boxes.shape
    R = C // 4
    ct = torch.promote_types(boxes.dtype, torch.float32)
    if R == 1:
        return boxes.to(ct).transpose(1, 2)
    p = boxes.to(ct).view(B, 4, R, A).softmax(2)
    return (p * torch.arange(R, dtype=ct, device=boxes.device).view(1, 1, R, 1)).sum(2).transpose(1, 2)


def decode(boxes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """ultralytics' ``bbox_decode``: ``(B, 4R, A)`` box outputs to ``(B, A, 4)`` xyxy boxes in grid
    units (differentiable)."""
    lt, rb = distances(boxes).chunk(2, -1)
    return torch.cat((anchors - lt, anchors + rb), -1)


def metric_torch(boxes, scores, gt, imgsz, anchors, strides, cfg: AssignConfig
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(align, ov, cand)`` of every (image, ground truth, anchor), ``(B, M, A)``, in torch
    operations in ultralytics' op order."""
    B, _, A = scores.shape
    M = gt.shape[1]
    pd = decode(boxes, anchors) * strides[:, None]
    centres = anchors * strides[:, None]
    labels = gt[..., 0].long()
    gtb = label_pixels(gt, imgsz)
    valid = gtb.sum(-1) > 0
    mid, wh = (gtb[..., :2] + gtb[..., 2:]) / 2, gtb[..., 2:] - gtb[..., :2]
    wh = torch.where((wh < cfg.stride_val) & valid[..., None], torch.full_like(wh, cfg.stride_val), wh) / 2
    lt, rb = (mid - wh)[:, :, None], (mid + wh)[:, :, None]
    inb = ((centres[:, 0] - lt[..., 0] > cfg.eps) & (centres[:, 1] - lt[..., 1] > cfg.eps)
           & (rb[..., 0] - centres[:, 0] > cfg.eps) & (rb[..., 1] - centres[:, 1] > cfg.eps))
    cand = inb & valid[..., None]
    ov = bbox_iou_reference(gtb[:, :, None], pd[:, None], xywh=False, CIoU=True).squeeze(-1).clamp(0)
    ov = torch.where(cand, ov, 0.0)
    sig = scores.to(torch.promote_types(scores.dtype, torch.float32)).sigmoid()
    sig = sig.gather(1, labels[..., None].clamp(0).expand(B, M, A))
    return torch.where(cand, sig.pow(cfg.alpha) * ov.pow(cfg.beta), 0.0), ov, cand


def assign_torch(boxes, scores, gt, imgsz, anchors, strides, cfg: AssignConfig) -> Assignment:
    """The same assignment in torch operations, dense over ``(B, M, A)``: the CPU path and the
    kernels' reference."""
    with torch.no_grad():
        align, ov, cand = metric_torch(boxes, scores, gt, imgsz, anchors, strides, cfg)
        return assignment_from_metric(align, ov, cand, gt[..., 0], cfg)


def assignment_from_metric(align: torch.Tensor, ov: torch.Tensor, cand: torch.Tensor, labels: torch.Tensor,
                           cfg: AssignConfig) -> Assignment:
    """The task-aligned assignment from its metric ``align``, overlaps ``ov`` and candidates
    ``cand`` (``(B, M, A)``) and the labels' classes ``(B, M)``, in torch operations (ultralytics'
    top-k, highest-overlap resolution, second k and target scores); the detection assigner's and
    the rotated one's (:mod:`trainfuse.ultralytics.obb_loss`)."""
    pos = topk_mask_torch(align, cfg.topk).bool() & cand
    count = pos.sum(1)
    gidx = torch.where(count > 1, ov.max(1).indices, pos.byte().max(1).indices)
    gidx = torch.where(count > 0, gidx, -1)
    if cfg.topk2 != cfg.topk:
        gidx = keep_topk2_torch(gidx, align, cfg.topk2)
    fg = gidx >= 0
    one = torch.zeros_like(pos).scatter_(1, gidx.clamp(0)[:, None], True) & fg[:, None]
    pos_align = (align * one).amax(-1, keepdim=True)
    pos_ov = (ov * one).amax(-1, keepdim=True)
    t = ((align * one) * pos_ov / (pos_align + cfg.eps)).amax(1)
    label = torch.where(fg, labels.long().gather(1, gidx.clamp(0)).clamp(0), -1)
    return Assignment(gidx.int(), label.int(), t, t.sum().clamp(min=1))


__all__ = ["AssignConfig", "Assignment", "assign_kernels", "assign_torch", "assignment_from_metric", "decode",
           "distances",
           "keep_topk2", "keep_topk2_torch", "metric", "metric_kernel", "metric_torch", "power_steps",
           "resolve", "resolve_kernel", "scores_kernel", "target_scores", "topk2_kernel", "topk_kernel",
           "topk_mask", "topk_mask_torch"]
