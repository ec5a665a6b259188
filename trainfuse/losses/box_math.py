"""Box geometry for Triton kernels: corners from either box format, loads and stores of box
grads, and min/max with torch's subgradients (ties split the grad, NaN wins). The IoU kernel
(``iou.py``) is built from these."""

import triton
import triton.language as tl


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


__all__ = ["axis_grads", "corners", "load_box", "max_grads", "min_grads", "store_box", "tmax", "tmin"]
