"""IoU, GIoU, DIoU and CIoU of box pairs, and the box-regression loss built on them, fused.

The math is ultralytics 8.4's ``bbox_iou`` (``ultralytics/utils/metrics.py``), operation for
operation, so swapping the import changes nothing but the speed. For boxes ``b1``, ``b2`` (corners
``x1 y1 x2 y2``, sizes ``w h``)::

    inter = clamp(min(x2) - max(x1), 0) * clamp(min(y2) - max(y1), 0)
    union = w1 h1 + w2 h2 - inter + eps,   IoU = inter / union
    GIoU  = IoU - (C - union) / C,          C = cw ch + eps        (cw, ch: enclosing box)
    DIoU  = IoU - rho2 / c2,                c2 = cw^2 + ch^2 + eps, rho2 = |centre1 - centre2|^2
    CIoU  = DIoU - alpha v,                 v = 4/pi^2 (atan(w2/h2) - atan(w1/h1))^2,
                                            alpha = v / (1 - IoU + v + eps), a constant in backward

Where eps goes differs between the formats, as in ultralytics: from ``xywh`` the sizes are taken
as given, from ``xyxy`` the heights are ``y2 - y1 + eps``.

``iou_loss(pred, target, weight)`` is ``reduce(weight * (1 - IoU))``; ultralytics' ``BboxLoss``
computes ``iou_loss(pred, target, weight, "ciou", reduction="sum") / target_scores_sum``.

One kernel does everything: the forward (one launch, the weighting and reduction included) and
the backward (one launch, recomputing the forward's intermediates from the boxes: 32 bytes a box
pair, cheaper than saving them). Math runs in float32 (float64 for float64 boxes: constants, eps,
atan (within 2 ulp) and the reduction are float64 too, so values and grads agree with ultralytics'
float64 ones to rounding, 1e-12 in the tests); the result and the grads come back in the inputs'
dtypes. Under fp16 autocast ultralytics runs the formula in fp16 itself; ours is the float32
value of the same formula (more accurate, on purpose).
Subgradients follow torch's autograd: a tie in min/max splits the grad in halves, and ``clamp(0)``
passes it at exactly 0 or not as the installed torch does (that changed between 2.11 and 2.15).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.function import applier
from trainfuse._runtime.reduce import reduce_partials
from trainfuse.losses._common import (
    REDUCTIONS,
    bcast_index,
    box_config,
    broadcast_operand,
    check_float,
    fast_div,
    launcher,
    workspace,
)
from trainfuse.losses.atan import atan
from trainfuse.losses.box_math import (
    aspect_penalty,
    aspect_penalty_grads,
    axis_grads,
    centre_penalty,
    centre_penalty_grads,
    corners,
    load_box,
    overlap,
    store_box,
    tmax,
    tmin,
)
from trainfuse.losses.iou_torch import bbox_iou_reference, iou_loss_reference, weight_view

KINDS = {"iou": 0, "giou": 1, "diou": 2, "ciou": 3}
IOU, GIOU, DIOU, CIOU = (tl.constexpr(v) for v in KINDS.values())
OUT_NONE, OUT_IOU, OUT_LOSS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)



@triton.jit
def _iou_kernel(b1_ptr, b2_ptr, w_ptr, go_ptr, out_ptr, g1_ptr, g2_ptr, partials, counter, total,
                n, b1_div, b1_mod, b2_div, b2_mod, w_div, w_mod, go_div, go_mod, denom,
                EPS: tl.constexpr, KIND: tl.constexpr, XYWH: tl.constexpr, B1_BCAST: tl.constexpr,
                B2_BCAST: tl.constexpr, HAS_W: tl.constexpr, W_BCAST: tl.constexpr,
                GO_BCAST: tl.constexpr, OUT: tl.constexpr,
                REDUCE: tl.constexpr, GRAD1: tl.constexpr, GRAD2: tl.constexpr,
                LOSS: tl.constexpr, CLAMP_AT_ZERO: tl.constexpr, CD: tl.constexpr,
                BLOCK: tl.constexpr, NB: tl.constexpr):
    """Rows ``[pid * BLOCK * NB, ...)`` of the broadcast box pairs. Writes, as the flags ask: the
    IoU (``OUT_IOU``) or ``w (1 - IoU)`` (``OUT_LOSS``) per row, the partial sum of ``w (1 - IoU)``
    (``REDUCE``, finished by the last program as ``sum / denom``), and the grads of both boxes
    scaled per row by ``c = go`` (bbox_iou) or ``c = -w go / denom`` (``LOSS``). ``EPS`` is a
    constexpr because a float argument arrives as float32 on a GPU; as a constant it is exact in
    float64."""
    eps = tl.full([], EPS, CD)
    pid = tl.program_id(0).to(tl.int64)
    part = tl.zeros([BLOCK], CD)
    for blk in tl.static_range(NB):
        offs = (pid * NB + blk) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        i1 = bcast_index(offs, b1_div, b1_mod, B1_BCAST)
        i2 = bcast_index(offs, b2_div, b2_mod, B2_BCAST)
        a0, a1, a2, a3 = load_box(b1_ptr, i1, mask, CD)
        c0, c1, c2_, c3 = load_box(b2_ptr, i2, mask, CD)
        b1x1, b1y1, b1x2, b1y2, w1, h1 = corners(a0, a1, a2, a3, eps, XYWH)
        b2x1, b2y1, b2x2, b2y2, w2, h2 = corners(c0, c1, c2_, c3, eps, XYWH)

        iou, union, iw_raw, ih_raw, iw, ih = overlap(b1x1, b1y1, b1x2, b1y2, b2x1, b2y1, b2x2, b2y2,
                                                     w1, h1, w2, h2, eps)
        val = iou
        if KIND != IOU:
            cw = tmax(b1x2, b2x2) - tmin(b1x1, b2x1)
            ch = tmax(b1y2, b2y2) - tmin(b1y1, b2y1)
            if KIND == GIOU:
                c_area = cw * ch + eps
                f = fast_div(c_area - union, c_area)
                val = iou - f
            else:
                q, c2, dx, dy = centre_penalty(b1x1, b1y1, b1x2, b1y2, b2x1, b2y1, b2x2, b2y2, cw, ch, eps)
                val = iou - q
                if KIND == CIOU:
                    va, r1, r2, d, alpha = aspect_penalty(w1, h1, w2, h2, iou, eps)
                    val = iou - (q + va)

        if HAS_W:
            wt = tl.load(w_ptr + bcast_index(offs, w_div, w_mod, W_BCAST), mask=mask, other=0.0).to(CD)
        else:
            wt = 1.0
        if OUT == OUT_IOU:
            tl.store(out_ptr + offs, val.to(out_ptr.dtype.element_ty), mask=mask)
        elif OUT == OUT_LOSS:
            tl.store(out_ptr + offs, (wt * (1 - val)).to(out_ptr.dtype.element_ty), mask=mask)
        if REDUCE:
            part += tl.where(mask, wt * (1 - val), 0.0)

        if GRAD1 or GRAD2:
            zero = tl.zeros([BLOCK], CD)
            c = tl.load(go_ptr + bcast_index(offs, go_div, go_mod, GO_BCAST), mask=mask,
                        other=0.0).to(CD)
            if LOSS:
                c = -wt * fast_div(c, tl.zeros([BLOCK], CD) + denom)
            # reverse mode through the forward above, torch's op order and subgradients
            g_iou = c
            g_union = zero
            g_cw = zero  # enclosing box width and height
            g_ch = zero
            g_dx = zero  # centre distance: x1 + x2 of box2 minus box1's
            g_dy = zero
            g_w1 = zero
            g_h1 = zero
            g_w2 = zero
            g_h2 = zero
            if KIND != IOU:
                if KIND == GIOU:
                    g_f = -c  # val = iou - f, f = (c_area - union) / c_area
                    g_num = fast_div(g_f, c_area)
                    g_ca = g_num - fast_div(g_f * f, c_area)
                    g_union = -g_num
                    g_cw = g_ca * ch
                    g_ch = g_ca * cw
                else:
                    g_cw, g_ch, g_dx, g_dy = centre_penalty_grads(-c, q, c2, cw, ch, dx, dy)
                    if KIND == CIOU:
                        a_w1, a_h1, a_w2, a_h2 = aspect_penalty_grads(-c, alpha, d, r1, r2, h1, h2)
                        g_w1 += a_w1
                        g_h1 += a_h1
                        g_w2 += a_w2
                        g_h2 += a_h2
            # iou = inter / union, union = w1 h1 + w2 h2 - inter + eps
            g_inter = fast_div(g_iou, union)
            g_union += -fast_div(g_iou * iou, union)
            g_inter -= g_union
            g_w1 += g_union * h1
            g_h1 += g_union * w1
            g_w2 += g_union * h2
            g_h2 += g_union * w2
            if CLAMP_AT_ZERO:
                g_iw = tl.where(iw_raw >= 0, g_inter * ih, 0.0)
                g_ih = tl.where(ih_raw >= 0, g_inter * iw, 0.0)
            else:
                g_iw = tl.where(iw_raw > 0, g_inter * ih, 0.0)
                g_ih = tl.where(ih_raw > 0, g_inter * iw, 0.0)
            gx1, gX1, gx2, gX2 = axis_grads(b1x1, b2x1, b1x2, b2x2, g_iw, g_cw, KIND != IOU)
            gy1, gY1, gy2, gY2 = axis_grads(b1y1, b2y1, b1y2, b2y2, g_ih, g_ch, KIND != IOU)
            if GRAD1:
                store_box(g1_ptr, offs, mask, gx1 - g_dx, gy1 - g_dy, gx2 - g_dx, gy2 - g_dy, g_w1, g_h1,
                           XYWH)
            if GRAD2:
                store_box(g2_ptr, offs, mask, gX1 + g_dx, gY1 + g_dy, gX2 + g_dx, gY2 + g_dy, g_w2, g_h2,
                           XYWH)
    if REDUCE:
        reduce_partials(partials, counter, total, tl.sum(part, 0), tl.num_programs(0), denom)


# ---- host side --------------------------------------------------------------------------------
def _kind(GIoU: bool, DIoU: bool, CIoU: bool) -> int:
    # ultralytics' precedence: CIoU, then DIoU, then GIoU
    return KINDS["ciou"] if CIoU else KINDS["diou"] if DIoU else KINDS["giou"] if GIoU else KINDS["iou"]


@functools.cache
def _clamp_at_zero() -> bool:
    """Whether this torch's ``clamp_(0)`` passes the grad at exactly 0 (torch 2.11 does, 2.15 does
    not): touching boxes get the grad ultralytics gets on the torch it runs with."""
    with torch.enable_grad():  # we get here from inside an autograd Function's forward
        x = torch.zeros(1, requires_grad=True)
        (x * 1).clamp_(0).backward()
    return bool(x.grad.item() == 1.0)


def _run(box1, box2, rows, kind, xywh, eps, *, weight=None, go=None, out=None, total=None, g1=None,
         g2=None, denom=1, loss=False, out_kind=0):
    n = math.prod(rows)
    f1, d1, m1, bc1 = broadcast_operand(box1, rows + (4,), inner=1)
    f2, d2, m2, bc2 = broadcast_operand(box2, rows + (4,), inner=1)
    # weight and an upstream grad come shaped like the IoU, rows + (1,)
    wf, wd, wm, wb = (f1, 1, 1, False) if weight is None else broadcast_operand(weight, rows + (1,))
    gf, gd, gm, gb = (f1, 1, 1, False) if go is None else broadcast_operand(go, rows + (1,))
    grid = box_config.programs(n)
    f64 = box1.dtype == torch.float64 or box2.dtype == torch.float64
    partials, count = workspace(f1.device, grid, torch.float64 if f64 else torch.float32)
    launcher(_iou_kernel, (grid,), f1, f2, wf, gf, f1 if out is None else out, f1 if g1 is None else g1,
             f1 if g2 is None else g2, partials, count, f1 if total is None else total,
             n, d1, m1, d2, m2, wd, wm, gd, gm, denom, EPS=eps,
             KIND=kind, XYWH=xywh, B1_BCAST=bc1, B2_BCAST=bc2, HAS_W=weight is not None,
             W_BCAST=wb, GO_BCAST=gb, OUT=out_kind, REDUCE=total is not None,
             GRAD1=g1 is not None, GRAD2=g2 is not None, LOSS=loss, CLAMP_AT_ZERO=_clamp_at_zero(),
             CD=tl.float64 if f64 else tl.float32, BLOCK=box_config.block, NB=box_config.unroll,
             num_warps=box_config.num_warps)


def _box_grads(ctx, rows, box1, box2):
    """Grad buffers for the boxes that need one: in the box's dtype, or float32 over the broadcast
    rows when the box is broadcast (then summed back by :func:`_fold_grad`)."""
    out = []
    for k, b in enumerate((box1, box2)):
        if not ctx.needs_input_grad[k]:
            out.append(None)
        elif b.shape[:-1] == rows:
            out.append(torch.empty(b.shape, dtype=b.dtype, device=b.device))
        else:
            out.append(torch.empty(rows + (4,), dtype=torch.float32, device=b.device))
    return out


def _fold_grad(g, box):
    if g is None or g.shape == box.shape:
        return g
    return g.sum_to_size(box.shape).to(box.dtype)


class BoxIoUFunction(torch.autograd.Function):
    """``bbox_iou`` on the kernels: forward one launch, backward one launch (plus a sum for a
    broadcast box)."""

    @staticmethod
    def forward(ctx, box1, box2, rows, xywh, kind, eps):
        dtype = box1.dtype if box1.dtype == box2.dtype else torch.result_type(box1, box2)
        out = torch.empty(rows + (1,), dtype=dtype, device=box1.device)
        _run(box1, box2, rows, kind, xywh, eps, out=out, out_kind=OUT_IOU.value)
        ctx.save_for_backward(box1, box2)
        ctx.args = rows, kind, xywh, eps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        box1, box2 = ctx.saved_tensors
        rows, kind, xywh, eps = ctx.args
        g1, g2 = _box_grads(ctx, rows, box1, box2)
        if g1 is not None or g2 is not None:
            _run(box1, box2, rows, kind, xywh, eps, go=go, g1=g1, g2=g2)
        return _fold_grad(g1, box1), _fold_grad(g2, box2), None, None, None, None


class IoULossFunction(torch.autograd.Function):
    """``iou_loss`` on the kernels: the forward (weighting and reduction included) and the
    backward are one launch each."""

    @staticmethod
    def forward(ctx, pred, target, weight, rows, kind, xywh, reduction, eps):
        dtype = pred.dtype if pred.dtype == target.dtype else torch.result_type(pred, target)
        if weight is not None:
            dtype = torch.promote_types(dtype, weight.dtype)
        n = math.prod(rows)
        if reduction == "none":
            out = torch.empty(rows + (1,), dtype=dtype, device=pred.device)
            _run(pred, target, rows, kind, xywh, eps, weight=weight, out=out, out_kind=OUT_LOSS.value)
        else:
            out = torch.empty((), dtype=dtype, device=pred.device)
            _run(pred, target, rows, kind, xywh, eps, weight=weight, total=out,
                 denom=n if reduction == "mean" else 1)
        ctx.save_for_backward(pred, target, weight)
        ctx.args = rows, kind, xywh, reduction, eps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go):
        pred, target, weight = ctx.saved_tensors
        rows, kind, xywh, reduction, eps = ctx.args
        g1, g2 = _box_grads(ctx, rows, pred, target)
        if g1 is not None or g2 is not None:
            _run(pred, target, rows, kind, xywh, eps, weight=weight,
                 go=go, g1=g1, g2=g2, loss=True,
                 denom=math.prod(rows) if reduction == "mean" else 1)
        return _fold_grad(g1, pred), _fold_grad(g2, target), None, None, None, None, None, None


# ---- public functions ---------------------------------------------------------------------------
_apply_box_iou = applier(BoxIoUFunction)
_apply_iou_loss = applier(IoULossFunction)


def _check_boxes(fn: str, box1, box2) -> tuple[int, ...]:
    check_float("box1", fn, box1)
    check_float("box2", fn, box2)
    for name, b in (("box1", box1), ("box2", box2)):
        if b.dim() == 0 or b.shape[-1] != 4:
            raise ValueError(f"{fn}: {name} must have 4 values in its last dimension, got shape "
                             f"{tuple(b.shape)}")
    if box1.device != box2.device:
        raise ValueError(f"{fn}: box1 is on {box1.device} and box2 on {box2.device}")
    if box1.shape == box2.shape:
        return tuple(box1.shape[:-1])
    try:
        return tuple(torch.broadcast_shapes(box1.shape[:-1], box2.shape[:-1]))
    except RuntimeError:
        raise ValueError(f"{fn}: box shapes {tuple(box1.shape)} and {tuple(box2.shape)} do not "
                         "broadcast") from None


def bbox_iou(box1: torch.Tensor, box2: torch.Tensor, xywh: bool = True, GIoU: bool = False,
             DIoU: bool = False, CIoU: bool = False, eps: float = 1e-7) -> torch.Tensor:
    """IoU / GIoU / DIoU / CIoU of ``box1`` and ``box2``: ultralytics 8.4's ``bbox_iou`` (same
    arguments, broadcasting, output shape ``broadcast(box1[..., :1], box2[..., :1])``), fused.

    Args:
        box1, box2: boxes in the last dimension (4 values), any broadcastable leading shapes,
            float32, float16, bfloat16 (mixed allowed) or float64.
        xywh: boxes are (centre x, centre y, w, h); else (x1, y1, x2, y2).
        GIoU, DIoU, CIoU: which variant (CIoU wins over DIoU over GIoU); plain IoU by default.
        eps: the small constant, placed as ultralytics places it.

    Returns:
        The IoU values, in the promoted dtype of the two inputs.

    Example:
        >>> b = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
        >>> bbox_iou(b, torch.tensor([[1.0, 0.0, 3.0, 2.0]]), xywh=False).tolist()
        [[0.3333333432674408]]
    """
    rows = _check_boxes("bbox_iou", box1, box2)
    if not use_triton(box1.device) or math.prod(rows) == 0:
        return bbox_iou_reference(box1, box2, xywh, GIoU, DIoU, CIoU, eps)
    return _apply_box_iou(box1, box2, rows, bool(xywh), _kind(GIoU, DIoU, CIoU), float(eps))


def iou_loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
             kind: str = "ciou", xywh: bool = False, reduction: str = "sum",
             eps: float = 1e-7) -> torch.Tensor:
    """``reduce(weight * (1 - IoU(pred, target)))`` in one launch forward and one backward.

    Args:
        pred, target: boxes (last dimension 4), broadcastable; mixed dtypes allowed (fp16
            predictions against fp32 targets under AMP); grads come back in each input's dtype.
        weight: optional, broadcastable to the IoU's shape ``(..., 1)`` (ultralytics passes
            ``(n, 1)``) or of the boxes' leading shape (one weight per box).
        kind: ``"iou"``, ``"giou"``, ``"diou"`` or ``"ciou"``.
        xywh: box format, as in :func:`bbox_iou` (default ``xyxy``, what ultralytics' BboxLoss
            passes).
        reduction: ``"sum"``, ``"mean"`` (over the boxes) or ``"none"`` (shape ``(..., 1)``).

    Returns:
        The loss: a scalar, or one value per box pair for ``"none"``.

    A weight that requires grad takes the torch path (its grad is not fused).

    Example:
        >>> p = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
        >>> round(iou_loss(p, p + 0.5, kind="giou").item(), 4)
        0.6887
    """
    if kind not in KINDS:
        raise ValueError(f"iou_loss: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"iou_loss: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    rows = _check_boxes("iou_loss", pred, target)
    if weight is not None:
        check_float("weight", "iou_loss", weight)
        if weight.device != pred.device:
            raise ValueError(f"iou_loss: weight is on {weight.device}, the boxes on {pred.device}")
        weight = weight_view(weight, rows)
    if (not use_triton(pred.device) or math.prod(rows) == 0
            or (weight is not None and weight.requires_grad and torch.is_grad_enabled())):
        return iou_loss_reference(pred, target, weight, kind, xywh, reduction, eps)
    return _apply_iou_loss(pred, target, weight, rows, KINDS[kind], bool(xywh), reduction, float(eps))


__all__ = ["BoxIoUFunction", "IoULossFunction", "atan", "bbox_iou", "bbox_iou_reference", "iou_loss",
           "iou_loss_reference"]
