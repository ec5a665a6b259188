"""The gradient-statistics pass: the global gradient norm, the clip coefficient and the inf/NaN
check of every gradient of a multi-tensor table, in one launch (per-chunk partials reduced by the
last program to arrive, in a fixed order, so the result is deterministic). Clipping, GradScaler's
check and the optimizers' ``max_grad_norm`` all run it. With ``UPDATE_SCALE`` it also does
GradScaler's ``update()`` (torch's ``_amp_update_scale_``) once every program has read the scale,
leaving the scale it read in ``out[3]`` for the update launch that follows."""

import triton
import triton.language as tl

from trainfuse._multi_tensor import kernels as mt
from trainfuse._runtime.reduce import last_to_arrive

NORM_NONE = tl.constexpr(0)  # only the inf/NaN check
NORM_L1 = tl.constexpr(1)
NORM_L2 = tl.constexpr(2)
NORM_INF = tl.constexpr(3)
# partials the last program adds a loop iteration at a time (tests under the interpreter shrink it,
# so that a few programs already take several iterations)
PARTIALS_BLOCK = tl.constexpr(1024)


@triton.jit
def _any_bits(flags):
    # bit 0: a NaN was seen, bit 1: an inf; OR over the block, one bit at a time
    return tl.max(flags & 1, 0) | tl.max(flags & 2, 0)


@triton.jit
def _stats_chunk(row, start, n, scale, PARAM_DT: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                 MASKED: tl.constexpr, ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr,
                 NORM: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    g_ptr = mt.operand(row, mt.OP_GRAD, start, PARAM_DT, ALIGNED)
    acc = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for b in tl.static_range(NB):
        g = mt.load(g_ptr, offs + b * BLOCK, n, MASKED)
        if HAS_SCALE:
            g = tl.div_rn(g, scale)
        a = tl.abs(g)
        bad = bad | (a != a).to(tl.int32) | (a == float("inf")).to(tl.int32) * 2
        if NORM == NORM_L2:
            acc += a * a
        elif NORM == NORM_L1:
            acc += a
        elif NORM == NORM_INF:
            acc = tl.maximum(acc, a)
    if NORM == NORM_INF:
        part = tl.max(acc, 0)
    else:
        part = tl.sum(acc, 0)
    return part, _any_bits(bad)


@triton.jit
def _update_scale(scale_ptr, tracker_ptr, found, growth_factor, backoff_factor, growth_interval):
    """torch's ``_amp_update_scale_``: back off on inf/NaN, else grow every ``growth_interval``
    clean steps (unless growing overflows float32). The factors are float32-exact (the caller
    checks), so the products round as torch's float64 ones do."""
    scale = tl.load(scale_ptr)
    successful = tl.load(tracker_ptr) + 1
    grown = scale * growth_factor
    grow = successful == growth_interval
    keep = tl.where(grow & (tl.abs(grown) != float("inf")) & (grown == grown), grown, scale)
    tl.store(scale_ptr, tl.where(found, scale * backoff_factor, keep))
    tl.store(tracker_ptr, tl.where(found | grow, 0, successful))


@triton.jit
def grad_stats_kernel(rows, chunks, scale_ptr, partials, flags, counter, out, max_norm,
                      tracker_ptr, growth_factor, backoff_factor, growth_interval,
                      BLOCK: tl.constexpr, NB: tl.constexpr, PARAM_DTYPES: tl.constexpr,
                      ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr,
                      UPDATE_SCALE: tl.constexpr):
    """Global gradient norm (of the unscaled grads) and inf/NaN check over the first ``nparts =
    counter[1]`` work items (the grid). Each program writes its partial and bumps ``counter[0]``;
    the last to arrive reduces the partials in a fixed order
    (float64, deterministic: no float atomics) and writes ``out = [norm, clip coefficient, found
    inf]`` with torch's ``clip_coef = min(max_norm / (norm + 1e-6), 1)``. With ``UPDATE_SCALE``
    (and ``HAS_SCALE``), that program then stores the scale every program divided by in ``out[3]``
    and updates the float32 scale and the int32 ``tracker_ptr`` as ``GradScaler.update()`` would:
    every other program has read the scale before it arrived.
    """
    pid = tl.program_id(0)
    r, row, start, n = mt.work_item(chunks, rows, BLOCK * NB)
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = 1.0
    code = tl.load(row + mt.COL_CODE) % 4
    part = 0.0
    bad = 0
    for c in tl.static_range(3):
        if (PARAM_DTYPES >> c) & 1:
            if code == c:
                PARAM_DT: tl.constexpr = tl.float32 if c == 0 else (tl.bfloat16 if c == 1 else tl.float16)
                if n == BLOCK * NB:
                    part, bad = _stats_chunk(row, start, n, scale, PARAM_DT, BLOCK, NB, False, ALIGNED,
                                             HAS_SCALE, NORM)
                else:
                    part, bad = _stats_chunk(row, start, n, scale, PARAM_DT, BLOCK, NB, True, ALIGNED,
                                             HAS_SCALE, NORM)
    nparts = tl.load(counter + 1)
    tl.store(partials + pid, part)
    tl.store(flags + pid, bad)
    if last_to_arrive(counter, nparts):
        acc = tl.zeros([PARTIALS_BLOCK], tl.float64)
        anybad = tl.zeros([PARTIALS_BLOCK], tl.int32)
        for i in range(0, nparts, PARTIALS_BLOCK):
            o = i + tl.arange(0, PARTIALS_BLOCK)
            x = tl.load(partials + o, mask=o < nparts, other=0.0, cache_modifier=".cg")
            anybad = anybad | tl.load(flags + o, mask=o < nparts, other=0, cache_modifier=".cg")
            if NORM == NORM_INF:
                acc = tl.maximum(acc, x.to(tl.float64))
            else:
                acc += x.to(tl.float64)
        allbad = _any_bits(anybad)
        if NORM == NORM_INF:
            total = tl.max(acc, 0)
        else:
            total = tl.sum(acc, 0)
        if NORM == NORM_L2:
            total = tl.sqrt(total)
        norm = total.to(tl.float32)
        norm = tl.where((allbad & 1) != 0, float("nan"), norm)  # NaN wins, as in torch's norms
        coef = max_norm / (norm + 1e-6)
        coef = tl.where(coef < 1.0, coef, tl.where(coef == coef, 1.0, coef))
        tl.store(out, norm)
        tl.store(out + 1, coef)
        tl.store(out + 2, tl.where(allbad != 0, 1.0, 0.0))
        if UPDATE_SCALE:
            tl.store(out + 3, scale)
            _update_scale(scale_ptr, tracker_ptr, allbad != 0, growth_factor, backoff_factor,
                          growth_interval)
        tl.store(counter, 0)
