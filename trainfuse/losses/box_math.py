"""Box geometry for Triton kernels: corners from either box format, loads and stores of box
grads, min/max with torch's subgradients (ties split the grad, NaN wins), and the DIoU/CIoU
penalty terms with their grads. The IoU kernel (``iou.py``) and the detection loss's box kernel
and assigner (``trainfuse/ultralytics``) are built from these: one copy of the CIoU math."""

import triton
import triton.language as tl

from trainfuse._runtime.rounding import fast_div
from trainfuse.losses.atan import atan

FOUR_OVER_PI2 = tl.constexpr(0.4052847345693511)  # CIoU's 4 / pi^2


@triton.jit
def tmin(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)  # NaN wins, as in torch.minimum


@triton.jit
def tmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def min_grads(a, b, g):
    # torch.minimum's backward: ties split the grad, NaN sends it to both sides
    ga = tl.where(a == b, g * 0.5, tl.where(a > b, 0.0, g))
    gb = tl.where(a == b, g * 0.5, tl.where(a < b, 0.0, g))
    return ga, gb


@triton.jit
def max_grads(a, b, g):
    ga = tl.where(a == b, g * 0.5, tl.where(a < b, 0.0, g))
    gb = tl.where(a == b, g * 0.5, tl.where(a > b, 0.0, g))
    return ga, gb


@triton.jit
def axis_grads(lo1, lo2, hi1, hi2, g_inter, g_enclose, ENCLOSE: tl.constexpr):
    """Grads of one axis's corners (box1's and box2's low and high edges) from the intersection
    extent min(hi) - max(lo) and, for GIoU/DIoU/CIoU, the enclosing extent max(hi) - min(lo)."""
    h1, h2 = min_grads(hi1, hi2, g_inter)
    l1, l2 = max_grads(lo1, lo2, g_inter)
    if ENCLOSE:
        eh1, eh2 = max_grads(hi1, hi2, g_enclose)
        el1, el2 = min_grads(lo1, lo2, g_enclose)
        h1 += eh1
        h2 += eh2
        l1 += el1
        l2 += el2
    return -l1, -l2, h1, h2


@triton.jit
def load_box(ptr, idx, mask, CD: tl.constexpr):
    p = ptr + idx * 4
    return (tl.load(p, mask=mask, other=0.0).to(CD), tl.load(p + 1, mask=mask, other=0.0).to(CD),
            tl.load(p + 2, mask=mask, other=0.0).to(CD), tl.load(p + 3, mask=mask, other=0.0).to(CD))


@triton.jit
def corners(a, b, c, d, eps, XYWH: tl.constexpr):
    # (x1, y1, x2, y2, w, h) as ultralytics derives them from either format
    if XYWH:
        hw = c / 2
        hh = d / 2
        return a - hw, b - hh, a + hw, b + hh, c, d
    return a, b, c, d, c - a, d - b + eps


@triton.jit
def store_box(ptr, idx, mask, gx1, gy1, gx2, gy2, gw, gh, XYWH: tl.constexpr):
    p = ptr + idx * 4
    dt = ptr.dtype.element_ty
    if XYWH:
        tl.store(p, (gx1 + gx2).to(dt), mask=mask)
        tl.store(p + 1, (gy1 + gy2).to(dt), mask=mask)
        tl.store(p + 2, ((gx2 - gx1) / 2 + gw).to(dt), mask=mask)
        tl.store(p + 3, ((gy2 - gy1) / 2 + gh).to(dt), mask=mask)
    else:
        tl.store(p, (gx1 - gw).to(dt), mask=mask)
        tl.store(p + 1, (gy1 - gh).to(dt), mask=mask)
        tl.store(p + 2, (gx2 + gw).to(dt), mask=mask)
        tl.store(p + 3, (gy2 + gh).to(dt), mask=mask)


@triton.jit
def centre_penalty(x1, y1, x2, y2, X1, Y1, X2, Y2, cw, ch, eps):
    """DIoU's penalty ``q = rho^2 / c^2`` of box1 (lower case) and box2 (capitals) with an
    enclosing box ``cw x ch``, ultralytics' op order; returns ``(q, c2, dx, dy)``."""
    c2 = cw * cw + ch * ch + eps
    dx = X1 + X2 - x1 - x2  # twice the centre distance along x
    dy = Y1 + Y2 - y1 - y2
    rho2 = (dx * dx + dy * dy) / 4
    return fast_div(rho2, c2), c2, dx, dy


@triton.jit
def centre_penalty_grads(g_q, q, c2, cw, ch, dx, dy):
    """Grads of :func:`centre_penalty`'s ``q`` (given ``g_q``): ``(g_cw, g_ch, g_dx, g_dy)``."""
    g_rho2 = fast_div(g_q, c2)
    g_c2 = -fast_div(g_q * q, c2)
    return g_c2 * 2 * cw, g_c2 * 2 * ch, g_rho2 / 4 * 2 * dx, g_rho2 / 4 * 2 * dy


@triton.jit
def aspect_penalty(w1, h1, w2, h2, iou, eps):
    """CIoU's aspect term ``v alpha``; returns ``(v alpha, r1, r2, d, alpha)``."""
    r1 = fast_div(w1, h1)
    r2 = fast_div(w2, h2)
    d = atan(r2) - atan(r1)
    v = FOUR_OVER_PI2 * (d * d)
    alpha = fast_div(v, 1 - iou + v + eps)
    return v * alpha, r1, r2, d, alpha


@triton.jit
def aspect_penalty_grads(g_va, alpha, d, r1, r2, h1, h2):
    """Grads of :func:`aspect_penalty`'s ``v alpha`` (given ``g_va``; alpha a constant, as
    ultralytics computes it under no_grad): ``(g_w1, g_h1, g_w2, g_h2)``."""
    g_d = g_va * alpha * FOUR_OVER_PI2 * 2 * d
    g_r2 = fast_div(g_d, r2 * r2 + 1)
    g_r1 = -fast_div(g_d, r1 * r1 + 1)
    return fast_div(g_r1, h1), -fast_div(g_r1 * r1, h1), fast_div(g_r2, h2), -fast_div(g_r2 * r2, h2)


@triton.jit
def overlap(x1, y1, x2, y2, X1, Y1, X2, Y2, w1, h1, w2, h2, eps):
    """Intersection over union of corner boxes with widths and heights ``w1, h1, w2, h2`` (heights
    with ``eps`` added, as ultralytics does); returns the IoU and what its grad needs:
    ``iou, union, iw_raw, ih_raw, iw, ih`` (``*_raw``: the overlap before clamping at zero)."""
    iw_raw = tmin(x2, X2) - tmax(x1, X1)
    ih_raw = tmin(y2, Y2) - tmax(y1, Y1)
    iw = tmax(iw_raw, 0.0)
    ih = tmax(ih_raw, 0.0)
    inter = iw * ih
    union = w1 * h1 + w2 * h2 - inter + eps
    return fast_div(inter, union), union, iw_raw, ih_raw, iw, ih


@triton.jit
def ciou_xyxy(x1, y1, x2, y2, X1, Y1, X2, Y2, eps):
    """CIoU of corner boxes (ultralytics' ``bbox_iou(xywh=False, CIoU=True)``); returns the value
    and what :func:`ciou_xyxy_grad1` needs."""
    w1 = x2 - x1
    h1 = y2 - y1 + eps
    w2 = X2 - X1
    h2 = Y2 - Y1 + eps
    iou, union, iw_raw, ih_raw, iw, ih = overlap(x1, y1, x2, y2, X1, Y1, X2, Y2, w1, h1, w2, h2, eps)
    cw = tmax(x2, X2) - tmin(x1, X1)
    ch = tmax(y2, Y2) - tmin(y1, Y1)
    q, c2, dx, dy = centre_penalty(x1, y1, x2, y2, X1, Y1, X2, Y2, cw, ch, eps)
    va, r1, r2, d, alpha = aspect_penalty(w1, h1, w2, h2, iou, eps)
    val = iou - (q + va)
    return val, (w1, h1, h2, iw_raw, ih_raw, iw, ih, union, iou, cw, ch, c2, dx, dy, q, r1, r2, d, alpha)


@triton.jit
def ciou_xyxy_grad1(c, x1, y1, x2, y2, X1, Y1, X2, Y2, saved):
    """Grads of ``c * CIoU`` with respect to box1's corners (``clamp(0)`` passes no grad at exactly
    0, as ultralytics' torch version does)."""
    w1, h1, h2, iw_raw, ih_raw, iw, ih, union, iou, cw, ch, c2, dx, dy, q, r1, r2, d, alpha = saved
    g_cw, g_ch, g_dx, g_dy = centre_penalty_grads(-c, q, c2, cw, ch, dx, dy)
    g_w1, g_h1, _, _ = aspect_penalty_grads(-c, alpha, d, r1, r2, h1, h2)
    g_inter = fast_div(c, union)
    g_union = -fast_div(c * iou, union)
    g_inter -= g_union
    g_w1 += g_union * h1
    g_h1 += g_union * w1
    g_iw = tl.where(iw_raw > 0, g_inter * ih, 0.0)
    g_ih = tl.where(ih_raw > 0, g_inter * iw, 0.0)
    gx1, _, gx2, _ = axis_grads(x1, X1, x2, X2, g_iw, g_cw, True)
    gy1, _, gy2, _ = axis_grads(y1, Y1, y2, Y2, g_ih, g_ch, True)
    return gx1 - g_w1 - g_dx, gy1 - g_h1 - g_dy, gx2 + g_w1 - g_dx, gy2 + g_h1 - g_dy


__all__ = ["FOUR_OVER_PI2", "aspect_penalty", "aspect_penalty_grads", "axis_grads", "centre_penalty",
           "centre_penalty_grads", "ciou_xyxy", "ciou_xyxy_grad1", "corners", "load_box", "max_grads",
           "min_grads", "store_box", "tmax", "tmin"]
