"""YOLOv8's class loss in one pass over the logits, in the head's own ``(B, nc, A)`` layout (no
permuted copy): the BCE-with-logits sum against the assigned soft targets, built in the kernel
from one label and one score per anchor (the dense ``(B, A, nc)`` target is never made)::

    y[b, c, a] = t[b, a] if c == label[b, a] else 0          (label -1: background)
    cls = sum_{b, c, a} w_c bce(x[b, c, a], y[b, c, a]) / tss
    d cls / d x = w_c (sigmoid(x) - y) / tss

``w`` are the optional class weights; ``tss`` (``target_scores_sum``) is read on the device. Math
in float32; the grad comes back in the logits' dtype. The autograd Function and the torch
reference of the whole loss are in ``terms.py`` (``DetectionLossFunction``, ``loss_terms_torch``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from trainfuse._runtime.reduce import last_to_arrive
from trainfuse._runtime.rounding import fast_div
from trainfuse.losses.bce import log1p_unit
from trainfuse.losses.detection.sums import arrive, gather_sum


@triton.jit
def _tile(x_ptr, lab_ptr, t_ptr, w_ptr, tile, nab, A, NC, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``tile``: anchors ``[ab * BLOCK, ...)`` of logit row ``r = (b, c)``, where
    ``tile = r * nab + ab``. Rows and blocks are scalars, so no element pays an integer division."""
    r = tile // nab
    c = r % NC
    offs = (tile % nab) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < A
    at = r * A + offs
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    ba = (r // NC) * A + offs
    lab = tl.load(lab_ptr + ba, mask=mask, other=-1)
    y = tl.where(lab == c, tl.load(t_ptr + ba, mask=mask, other=0.0), 0.0)
    e = tl.exp(-tl.abs(x))
    if HAS_W:
        w = tl.load(w_ptr + c).to(tl.float32)
    else:
        w = 1.0
    return at, mask, x, y, e, w


@triton.jit
def cls_loss_fwd_kernel(x_ptr, lab_ptr, t_ptr, w_ptr, tss_ptr, out_ptr, items_ptr, partials, counter,
                        ntiles, nab, A, NC, gain, batch, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Persistent grid over the ``ntiles`` tiles; the last program writes ``items[1] = cls * gain``
    and ``out[1] = items[1] * batch``."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit row offsets
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for tile in range(pid, ntiles, nprog):
        _, mask, x, y, e, w = _tile(x_ptr, lab_ptr, t_ptr, w_ptr, tile, nab, A, NC, HAS_W, BLOCK)
        loss = (1.0 - y) * x - (tl.minimum(x, 0.0) - log1p_unit(e))  # (1 - y) x - log sigmoid(x)
        acc += tl.where(mask, loss * w, 0.0)
    arrive(partials, nprog, 0, tl.sum(acc, 0))
    if last_to_arrive(counter, nprog):
        cls = gather_sum(partials, nprog, 0) / tl.load(tss_ptr).to(tl.float64) * gain
        tl.store(items_ptr + 1, cls.to(tl.float32))
        tl.store(out_ptr + 1, (cls * batch).to(tl.float32))
        tl.store(counter, 0)


@triton.jit
def cls_loss_bwd_kernel(x_ptr, lab_ptr, t_ptr, w_ptr, tss_ptr, go_ptr, go_stride, g_ptr, ntiles, nab, A, NC,
                        gain, batch, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """``g = go[1] batch gain w (sigmoid(x) - y) / tss`` over a persistent grid."""
    pid = tl.program_id(0).to(tl.int64)
    scale = tl.load(go_ptr + go_stride).to(tl.float32) * (batch * gain) / tl.load(tss_ptr).to(tl.float32)
    for tile in range(pid, ntiles, tl.num_programs(0)):
        at, mask, x, y, e, w = _tile(x_ptr, lab_ptr, t_ptr, w_ptr, tile, nab, A, NC, HAS_W, BLOCK)
        r = fast_div(tl.full(e.shape, 1.0, tl.float32), 1.0 + e)
        s = tl.where(x >= 0, r, e * r)  # sigmoid(x) without cancellation on either side
        g = (s - y) * (w * scale)
        tl.store(g_ptr + at, g.to(g_ptr.dtype.element_ty), mask=mask)


def cls_tiles(batch: int, nc: int, anchors: int, block: int) -> tuple[int, int]:
    """``(tiles, anchor blocks per row)`` of the class loss over ``(batch, nc, anchors)``."""
    nab = -(-anchors // block)
    return batch * nc * nab, nab


__all__ = ["cls_loss_bwd_kernel", "cls_loss_fwd_kernel", "cls_tiles"]
