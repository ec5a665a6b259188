"""YOLOv8's box losses over the foreground, straight from the head's box outputs: CIoU and DFL (or,
for a head without DFL, YOLO26's L1), forward and backward, one launch each, masked (no gathers),
the reductions inside.

For anchor ``a`` of image ``b`` with assigned ground truth ``g`` (``gidx[b, a] >= 0``) and target
score ``t = t[b, a]``, in grid units (``s`` the anchor's stride, ``R = reg_max``)::

    p_k   = softmax(logits[b, k*R:(k+1)*R, a])            k = left, top, right, bottom
    d_k   = sum_j j p_kj                                   (ultralytics' bbox_decode; R = 1: the output)
    pred  = (ax - d_0, ay - d_1, ax + d_2, ay + d_3)       (xyxy)
    box   = label_xyxy[b, g] / s                          (pixels from the normalized labels)
    iou   = sum_a t (1 - CIoU(pred, box)) / tss
    y_k   = clamp(bbox2dist(anchor, box)_k, 0, R - 1.01),  l = floor(y_k), w_l = l + 1 - y_k
    dfl   = sum_a t mean_k -(w_l log p_k,l + (1 - w_l) log p_k,l+1) / tss            R > 1
    l1    = sum_a t mean_k |d_k s / n_k - bbox2dist(anchor, box)_k s / n_k| / tss    R = 1

with ``n_k`` the image's width for left and right, its height for top and bottom. ``R`` is a
compile-time constant: a DFL head's kernels hold no trace of the L1 branch, and the other way round.

``tss`` (``target_scores_sum``, on the device) divides in the kernel: no host sync. Background
anchors load nothing and get a zero grad. The CIoU is ultralytics' ``bbox_iou(..., xywh=False,
CIoU=True)`` with its subgradients (ties in min/max split the grad; ``clamp(0)`` passes none at
exactly 0): ``trainfuse.losses.box_math.ciou_xyxy``, the IoU kernel's own terms. Math in float32;
the grads come back in the logits' dtype. The autograd Function and the torch reference of the
whole loss are in ``terms.py`` (``DetectionLossFunction``, ``loss_terms_torch``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from trainfuse._runtime.reduce import last_to_arrive
from trainfuse.losses.box_math import ciou_xyxy, ciou_xyxy_grad1
from trainfuse.losses.detection.sums import arrive, gather_sum

CIOU_EPS = 1e-7  # bbox_iou's default eps, as BboxLoss and the assigner call it
# TRAINFUSE_BOX_RECOMPUTE=1: the backward makes each side's softmax again (box_loss_bwd_kernel's
# RECOMPUTE), opt-in until timed on a GPU
RECOMPUTE_SOFTMAX = os.environ.get("TRAINFUSE_BOX_RECOMPUTE", "0") == "1"


@triton.jit
def side_softmax(base, k, offs, mask, A, R: tl.constexpr):
    """Side ``k``'s logit tile ``(BLOCK, R)`` of the anchors ``offs``: the logits, their softmax,
    its log-normalizer and the expected distance ``sum_j j p_j``."""
    j = tl.arange(0, R)
    x = tl.load(base + (k * R + j)[None, :] * A + offs[:, None], mask=mask[:, None], other=0.0).to(tl.float32)
    m = tl.max(x, 1)
    e = tl.exp(x - m[:, None])
    z = tl.sum(e, 1)
    p = e / z[:, None]
    dist = tl.sum(p * j[None, :].to(tl.float32), 1)
    return x, p, m + tl.log(z), dist


@triton.jit
def side_distance(base, k, offs, mask, A, R: tl.constexpr):
    """Side ``k``'s predicted distance (grid units) of the anchors ``offs``: the DFL expectation
    for ``R > 1``, the output itself for ``R = 1`` (ultralytics' ``bbox_decode``)."""
    if R == 1:
        d = tl.load(base + k * A + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        _, _, _, d = side_softmax(base, k, offs, mask, A, R)
    return d


@triton.jit
def _side_l1(d, y, s, n):
    """One side's L1 term on the scale ultralytics takes it: distances in pixels over the image's
    side ``n``, op for op; and the difference, whose sign is the term's subgradient."""
    diff = d * s / n - y * s / n
    return tl.abs(diff), diff


@triton.jit
def _dfl_target(y, hi):
    y = tl.minimum(tl.maximum(y, 0.0), hi)
    lo = y.to(tl.int32)  # y >= 0: truncation is floor, as .long() in ultralytics
    wl = (lo + 1).to(tl.float32) - y
    return lo, wl, 1 - wl


@triton.jit
def _side_dfl(x, lse, lo, wl, wr, R: tl.constexpr):
    j = tl.arange(0, R)[None, :]
    xl = tl.sum(tl.where(j == lo[:, None], x, 0.0), 1)
    xr = tl.sum(tl.where(j == lo[:, None] + 1, x, 0.0), 1)
    return (xl - lse) * wl + (xr - lse) * wr


@triton.jit
def label_box(row, mask, W, H):
    """The pixel ``xyxy`` box of label rows ``row`` (pointers to ``(class, x, y, w, h)``,
    normalized): ultralytics' ``preprocess`` scaling and ``xywh2xyxy``, op for op."""
    x = tl.load(row + 1, mask=mask, other=0.0) * W
    y = tl.load(row + 2, mask=mask, other=0.0) * H
    w = tl.load(row + 3, mask=mask, other=0.0) * W / 2
    h = tl.load(row + 4, mask=mask, other=0.0) * H / 2
    return x - w, y - h, x + w, y + h


@triton.jit
def _load_anchor(gidx_ptr, t_ptr, gt_ptr, anc_ptr, stride_ptr, b, offs, A, M, W, H):
    am = offs < A
    gi = tl.load(gidx_ptr + b * A + offs, mask=am, other=-1)
    fg = gi >= 0
    t = tl.load(t_ptr + b * A + offs, mask=fg, other=0.0)
    ax = tl.load(anc_ptr + offs * 2, mask=am, other=0.0)
    ay = tl.load(anc_ptr + offs * 2 + 1, mask=am, other=0.0)
    s = tl.load(stride_ptr + offs, mask=am, other=1.0)
    X1, Y1, X2, Y2 = label_box(gt_ptr + (b * M + gi) * 5, fg, W, H)
    return am, fg, t, ax, ay, s, X1 / s, Y1 / s, X2 / s, Y2 / s


@triton.jit(do_not_specialize=["M"])
def box_loss_fwd_kernel(boxes, gidx_ptr, t_ptr, gt_ptr, anc_ptr, stride_ptr, tss_ptr, out_ptr, items_ptr,
                        partials, counter, A, M, W, H, nparts, hi, eps, box_gain, dfl_gain, batch,
                        R: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid``: anchors ``[ab * BLOCK, ...)`` of image ``b``; the last program writes
    ``items[0] = iou * box_gain``, ``items[2] = dfl * dfl_gain`` (``l1 * dfl_gain`` for
    ``R = 1``) and ``out = items * batch``."""
    pid = tl.program_id(0)
    nblk = tl.cdiv(A, BLOCK)
    b = pid // nblk
    offs = (pid % nblk) * BLOCK + tl.arange(0, BLOCK)
    am, fg, t, ax, ay, s, X1, Y1, X2, Y2 = _load_anchor(gidx_ptr, t_ptr, gt_ptr, anc_ptr, stride_ptr, b, offs,
                                                        A, M, W, H)
    base = boxes + b.to(tl.int64) * (4 * R) * A
    if R == 1:
        d0 = side_distance(base, 0, offs, fg, A, R)
        d1 = side_distance(base, 1, offs, fg, A, R)
        d2 = side_distance(base, 2, offs, fg, A, R)
        d3 = side_distance(base, 3, offs, fg, A, R)
        l0, _ = _side_l1(d0, ax - X1, s, W)
        l1, _ = _side_l1(d1, ay - Y1, s, H)
        l2, _ = _side_l1(d2, X2 - ax, s, W)
        l3, _ = _side_l1(d3, Y2 - ay, s, H)
        dfl_part = tl.sum(tl.where(fg, (l0 + l1 + l2 + l3) / 4 * t, 0.0), 0)
    else:
        x0, p0, lse0, d0 = side_softmax(base, 0, offs, fg, A, R)
        x1, p1, lse1, d1 = side_softmax(base, 1, offs, fg, A, R)
        x2, p2, lse2, d2 = side_softmax(base, 2, offs, fg, A, R)
        x3, p3, lse3, d3 = side_softmax(base, 3, offs, fg, A, R)
        lo0, wl0, wr0 = _dfl_target(ax - X1, hi)
        lo1, wl1, wr1 = _dfl_target(ay - Y1, hi)
        lo2, wl2, wr2 = _dfl_target(X2 - ax, hi)
        lo3, wl3, wr3 = _dfl_target(Y2 - ay, hi)
        ll = (_side_dfl(x0, lse0, lo0, wl0, wr0, R) + _side_dfl(x1, lse1, lo1, wl1, wr1, R)
              + _side_dfl(x2, lse2, lo2, wl2, wr2, R) + _side_dfl(x3, lse3, lo3, wl3, wr3, R))
        dfl_part = tl.sum(tl.where(fg, -(ll / 4) * t, 0.0), 0)
    val, _ = ciou_xyxy(ax - d0, ay - d1, ax + d2, ay + d3, X1, Y1, X2, Y2, eps)
    iou_part = tl.sum(tl.where(fg, (1.0 - val) * t, 0.0), 0)
    arrive(partials, nparts, 0, iou_part)
    arrive(partials, nparts, 1, dfl_part)
    if last_to_arrive(counter, nparts):
        tss = tl.load(tss_ptr).to(tl.float64)
        box = gather_sum(partials, nparts, 0) / tss * box_gain
        dfl = gather_sum(partials, nparts, 1) / tss * dfl_gain
        tl.store(items_ptr, box.to(tl.float32))
        tl.store(items_ptr + 2, dfl.to(tl.float32))
        tl.store(out_ptr, (box * batch).to(tl.float32))
        tl.store(out_ptr + 2, (dfl * batch).to(tl.float32))
        tl.store(counter, 0)


@triton.jit
def _side_grad(g_base, k, offs, am, fg, p, dist, g_dist, c_dfl, lo, wl, wr, A, R: tl.constexpr):
    j = tl.arange(0, R)[None, :]
    g = g_dist[:, None] * p * (j.to(tl.float32) - dist[:, None])
    g += c_dfl[:, None] * (p * (wl + wr)[:, None] - tl.where(j == lo[:, None], wl[:, None], 0.0)
                           - tl.where(j == lo[:, None] + 1, wr[:, None], 0.0))
    g = tl.where(fg[:, None], g, 0.0)
    tl.store(g_base + (k * R + j) * A + offs[:, None], g.to(g_base.dtype.element_ty), mask=am[:, None])


@triton.jit
def _side_l1_grad(g_base, k, offs, am, fg, g_dist, c_l1, d, y, s, n, A):
    _, diff = _side_l1(d, y, s, n)
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))  # torch's l1 subgradient: 0 at 0
    g = tl.where(fg, g_dist + c_l1 * sign * s / n, 0.0)
    tl.store(g_base + k * A + offs, g.to(g_base.dtype.element_ty), mask=am)


@triton.jit
def _side_grad_again(base, g_base, k, offs, am, fg, g_dist, c_dfl, y, hi, A, R: tl.constexpr):
    """:func:`_side_grad` with side ``k``'s softmax made again (the same ops, the same bits): one
    side's ``(BLOCK, R)`` tile live at a time instead of all four."""
    _, p, _, dist = side_softmax(base, k, offs, fg, A, R)
    lo, wl, wr = _dfl_target(y, hi)
    _side_grad(g_base, k, offs, am, fg, p, dist, g_dist, c_dfl, lo, wl, wr, A, R)


@triton.jit(do_not_specialize=["M"])
def box_loss_bwd_kernel(boxes, grad, gidx_ptr, t_ptr, gt_ptr, anc_ptr, stride_ptr, tss_ptr, go_ptr, go_stride,
                        A, M, W, H, hi, eps, box_gain, dfl_gain, batch, R: tl.constexpr, BLOCK: tl.constexpr,
                        RECOMPUTE: tl.constexpr):
    """The grad of ``go . out`` (``out`` from :func:`box_loss_fwd_kernel`) for the box outputs;
    zeros on background anchors. ``RECOMPUTE`` (:data:`RECOMPUTE_SOFTMAX`): each side's softmax
    made again for its grad rather than held for all four sides (compiled for sm_90 at 128
    anchors a block: 255 registers and 120 bytes spilled against 304)."""
    pid = tl.program_id(0)
    nblk = tl.cdiv(A, BLOCK)
    b = pid // nblk
    offs = (pid % nblk) * BLOCK + tl.arange(0, BLOCK)
    am, fg, t, ax, ay, s, X1, Y1, X2, Y2 = _load_anchor(gidx_ptr, t_ptr, gt_ptr, anc_ptr, stride_ptr, b, offs,
                                                        A, M, W, H)
    base = boxes + b.to(tl.int64) * (4 * R) * A
    g_base = grad + b.to(tl.int64) * (4 * R) * A
    if R == 1:
        d0 = side_distance(base, 0, offs, fg, A, R)
        d1 = side_distance(base, 1, offs, fg, A, R)
        d2 = side_distance(base, 2, offs, fg, A, R)
        d3 = side_distance(base, 3, offs, fg, A, R)
    elif RECOMPUTE:
        d0 = side_distance(base, 0, offs, fg, A, R)
        d1 = side_distance(base, 1, offs, fg, A, R)
        d2 = side_distance(base, 2, offs, fg, A, R)
        d3 = side_distance(base, 3, offs, fg, A, R)
    else:
        _, p0, _, d0 = side_softmax(base, 0, offs, fg, A, R)
        _, p1, _, d1 = side_softmax(base, 1, offs, fg, A, R)
        _, p2, _, d2 = side_softmax(base, 2, offs, fg, A, R)
        _, p3, _, d3 = side_softmax(base, 3, offs, fg, A, R)
    inv = 1.0 / tl.load(tss_ptr).to(tl.float32)
    c_box = tl.load(go_ptr).to(tl.float32) * (batch * box_gain) * inv * t
    c_dfl = tl.load(go_ptr + 2 * go_stride).to(tl.float32) * (batch * dfl_gain) * inv * t / 4
    px1 = ax - d0
    py1 = ay - d1
    px2 = ax + d2
    py2 = ay + d3
    _, saved = ciou_xyxy(px1, py1, px2, py2, X1, Y1, X2, Y2, eps)
    # loss = c_box (1 - CIoU): grads of -c_box CIoU
    gx1, gy1, gx2, gy2 = ciou_xyxy_grad1(-c_box, px1, py1, px2, py2, X1, Y1, X2, Y2, saved)
    if R == 1:
        _side_l1_grad(g_base, 0, offs, am, fg, -gx1, c_dfl, d0, ax - X1, s, W, A)
        _side_l1_grad(g_base, 1, offs, am, fg, -gy1, c_dfl, d1, ay - Y1, s, H, A)
        _side_l1_grad(g_base, 2, offs, am, fg, gx2, c_dfl, d2, X2 - ax, s, W, A)
        _side_l1_grad(g_base, 3, offs, am, fg, gy2, c_dfl, d3, Y2 - ay, s, H, A)
    elif RECOMPUTE:
        _side_grad_again(base, g_base, 0, offs, am, fg, -gx1, c_dfl, ax - X1, hi, A, R)
        _side_grad_again(base, g_base, 1, offs, am, fg, -gy1, c_dfl, ay - Y1, hi, A, R)
        _side_grad_again(base, g_base, 2, offs, am, fg, gx2, c_dfl, X2 - ax, hi, A, R)
        _side_grad_again(base, g_base, 3, offs, am, fg, gy2, c_dfl, Y2 - ay, hi, A, R)
    else:
        lo0, wl0, wr0 = _dfl_target(ax - X1, hi)
        lo1, wl1, wr1 = _dfl_target(ay - Y1, hi)
        lo2, wl2, wr2 = _dfl_target(X2 - ax, hi)
        lo3, wl3, wr3 = _dfl_target(Y2 - ay, hi)
        _side_grad(g_base, 0, offs, am, fg, p0, d0, -gx1, c_dfl, lo0, wl0, wr0, A, R)
        _side_grad(g_base, 1, offs, am, fg, p1, d1, -gy1, c_dfl, lo1, wl1, wr1, A, R)
        _side_grad(g_base, 2, offs, am, fg, p2, d2, gx2, c_dfl, lo2, wl2, wr2, A, R)
        _side_grad(g_base, 3, offs, am, fg, p3, d3, gy2, c_dfl, lo3, wl3, wr3, A, R)


__all__ = ["CIOU_EPS", "RECOMPUTE_SOFTMAX", "box_loss_bwd_kernel", "box_loss_fwd_kernel", "label_box",
           "side_distance", "side_softmax"]
