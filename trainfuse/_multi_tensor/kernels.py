"""Triton building blocks shared by every multi-tensor kernel (optimizers, EMA, clipping).

A launch walks *work items*: one program per (tensor, chunk of ``NB`` blocks of ``BLOCK`` elements;
each program loads block b + 1 before it computes and stores block b, so the scalar work of a
program and the latency of its loads overlap). The host side (``tables.py``) writes
two int64 tables on the device:

- ``rows[t, :]`` — one row per tensor: operand addresses by slot (param, grad, float32 master,
  EMA, states), step address, numel, group, row code (dtypes and what the row does).
- ``chunks[pid]`` — ``(t << 32) | chunk`` for program ``pid``.

Each client kernel is a ``chunk_fn`` handed to :func:`run`: it reads its hyperparameters from a
float64 per-group table and applies its own elementwise math with :func:`load` / :func:`store`;
the pieces every update shares (grad unscale and clip, master weights, EMA) are helpers here.
The one reduction, the global gradient norm and inf/NaN check, is ``stats.grad_stats_kernel``.
"""

import os

import triton
import triton.language as tl

from trainfuse._runtime.rounding import round_bf16_rne

ROW = tl.constexpr(16)  # int64 columns per tensor row; 16 keeps the chunk table 128-byte aligned
COL_OPERAND0 = tl.constexpr(0)  # eight operand addresses, slots below
OP_PARAM = tl.constexpr(0)  # the param as the model reads it (float32, bfloat16 or float16)
OP_GRAD = tl.constexpr(1)  # its gradient, same dtype
OP_MASTER = tl.constexpr(2)  # float32 master copy of a 16-bit param (row code MASTER)
OP_EMA = tl.constexpr(3)  # EMA copy of the param (row code EMA), or of a buffer (EMA_ONLY)
OP_STATE = tl.constexpr(4)  # up to four optimizer states, slots 4..7
COL_STEP = tl.constexpr(8)  # address of the tensor's float32 step counter
COL_NUMEL = tl.constexpr(9)
COL_GROUP = tl.constexpr(10)
COL_CODE = tl.constexpr(11)  # row code, bits below
COL_NCHUNKS = tl.constexpr(12)

# Row code: bits 0-1 the param dtype (0 float32, 1 bfloat16, 2 float16); MASTER: float32 master
# weight and float32 states, the param is written as its 16-bit copy; EMA: the updated weight is
# also folded into OP_EMA; EMA_LOW: that EMA tensor has the param's dtype (else float32);
# EMA_ONLY: no update, only ema = lerp(ema, OP_PARAM, w) (buffers, frozen params). A launch
# carries the set of codes present as a bit mask (CODES) and compiles one arm per code.
CODE_MASTER = tl.constexpr(4)
CODE_EMA = tl.constexpr(8)
CODE_EMA_LOW = tl.constexpr(16)
CODE_EMA_ONLY = tl.constexpr(32)
NCODES = tl.constexpr(64)

# HAS_CLIP, the clipping a launch applies to the unscaled gradient with the value at ``clip_ptr``:
# none, times a clip coefficient (clip_grad_norm_'s second pass), clamped to [-v, v] (clip_grad_value_)
CLIP_NONE = tl.constexpr(0)
CLIP_NORM = tl.constexpr(1)
CLIP_VALUE = tl.constexpr(2)

# The interpreter (triton <= 3.9) truncates float32 -> bfloat16 instead of rounding to nearest even;
# round by hand there so CPU tests see the bits the GPU writes. Compiled kernels use the native cvt.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def work_item(chunks_ptr, rows_ptr, CHUNK: tl.constexpr):
    """This program's tensor row ``r``, row pointer, first element and element count (<= CHUNK)."""
    item = tl.load(chunks_ptr + tl.program_id(0))
    r = item >> 32
    c = item - (r << 32)
    row = rows_ptr + r * ROW
    numel = tl.load(row + COL_NUMEL)
    start = c * CHUNK
    n = tl.minimum(numel - start, CHUNK)
    return r, row, start, n


@triton.jit
def operand(row, k: tl.constexpr, start, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to element ``start`` of operand ``k``; ALIGNED promises 16-byte aligned bases so
    loads vectorize (the host checks every address before it sets it)."""
    addr = tl.load(row + COL_OPERAND0 + k)
    ptr = addr.to(tl.pointer_type(DT)) + start
    if ALIGNED:
        # on the pointer itself: the alignment of the integer address does not carry through
        # the int-to-pointer cast (every access compiled to a scalar 32-bit load or store)
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def load(ptr, offs, n, MASKED: tl.constexpr):
    """Load as float32; full chunks skip the mask so the compiler can use 16-byte accesses."""
    if MASKED:
        x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(ptr + offs)
    return x.to(tl.float32)


@triton.jit
def _optional_mask(offs, n, flag, MASKED: tl.constexpr):
    # A scalar mask keeps full blocks vectorized when compiled; the interpreter (triton <= 3.9)
    # rejects scalar masks and scalar & block, so it gets the equivalent element mask.
    if MASKED or _INTERPRET:
        return offs < tl.where(flag, n, 0)
    else:
        return flag


@triton.jit
def load_if(ptr, offs, n, flag, MASKED: tl.constexpr):
    """:func:`load` of an optional operand: nothing is read (zeros come back) unless ``flag``."""
    return tl.load(ptr + offs, mask=_optional_mask(offs, n, flag, MASKED), other=0.0).to(tl.float32)


@triton.jit
def store(ptr, offs, n, x, MASKED: tl.constexpr):
    """Store float32 ``x`` rounded to the operand's dtype (round to nearest even)."""
    ty = ptr.dtype.element_ty
    if _INTERPRET:
        if ty == tl.bfloat16:
            x = round_bf16_rne(x)
    if MASKED:
        tl.store(ptr + offs, x.to(ty), mask=offs < n)
    else:
        tl.store(ptr + offs, x.to(ty))


@triton.jit
def store_if(ptr, offs, n, x, flag, MASKED: tl.constexpr):
    """:func:`store` of an optional operand, skipped unless ``flag``."""
    ty = ptr.dtype.element_ty
    if _INTERPRET:
        if ty == tl.bfloat16:
            x = round_bf16_rne(x)
    tl.store(ptr + offs, x.to(ty), mask=_optional_mask(offs, n, flag, MASKED))


@triton.jit
def live(inf_ptr, HAS_INF: tl.constexpr):
    """False when GradScaler found an inf/NaN: the update is then skipped."""
    if HAS_INF:
        ok = tl.load(inf_ptr) == 0.0
    else:
        ok = True
    return ok


@triton.jit
def advance_step(row, r, arrivals_ptr):
    """Return this tensor's step count after the update (old + 1) and write it back once.

    Every program of a tensor must read the old count, so the write waits for the last one to
    arrive: each program bumps ``arrivals[r]`` (acq_rel, after its read) and the last resets it.
    Called after the operand loads are issued, so its latency hides behind theirs.
    """
    step_ptr = tl.load(row + COL_STEP).to(tl.pointer_type(tl.float32))
    new = tl.load(step_ptr) + 1.0
    nchunks = tl.load(row + COL_NCHUNKS)
    if nchunks == 1:
        tl.store(step_ptr, new)
    else:
        arrived = tl.atomic_add(arrivals_ptr + r, 1)
        if arrived == nchunks - 1:
            tl.store(step_ptr, new)
            tl.store(arrivals_ptr + r, 0)
    return new


@triton.jit
def hparams_row(hp_ptr, row, WIDTH: tl.constexpr):
    """Pointer to this tensor's param-group row in the float64 hyperparameter table."""
    return hp_ptr + tl.load(row + COL_GROUP) * WIDTH


# ---- pieces of an update, shared by the optimizers -------------------------------------------
@triton.jit
def weight_ptrs(row, start, PARAM_DT: tl.constexpr, MASTER: tl.constexpr, ALIGNED: tl.constexpr):
    """(weight the update reads and writes, param the model reads): the float32 master and the
    16-bit param under MASTER, else the param twice."""
    p_ptr = operand(row, OP_PARAM, start, PARAM_DT, ALIGNED)
    if MASTER:
        w_ptr = operand(row, OP_MASTER, start, tl.float32, ALIGNED)
    else:
        w_ptr = p_ptr
    return w_ptr, p_ptr


@triton.jit
def store_weight(w_ptr, p_ptr, offs, n, w, MASTER: tl.constexpr, MASKED: tl.constexpr):
    """Write the updated weight; under MASTER also its 16-bit copy, the one the next forward reads
    (this is the cast fusion: no separate cast kernel runs)."""
    store(w_ptr, offs, n, w, MASKED)
    if MASTER:
        store(p_ptr, offs, n, w, MASKED)


@triton.jit
def grad_in(g_ptr, offs, n, g, scale, clip, maximize, HAS_SCALE: tl.constexpr,
            HAS_CLIP: tl.constexpr, MASKED: tl.constexpr):
    """The gradient an update uses: divided by GradScaler's scale, clipped as HAS_CLIP says (times
    the clip coefficient, or clamped to [-clip, clip] with NaN kept, as torch.clamp), written back
    that way (what unscale_ + clip_grad_norm_ / clip_grad_value_ leave in .grad), negated to
    maximize. The clamp bound is ``clip`` as the grad's dtype stores it: a clamped element then
    holds the bits clip_grad_value_ writes, also in the float32 math beside a master weight."""
    if HAS_SCALE:
        g = tl.div_rn(g, scale)
    if HAS_CLIP == CLIP_NORM:
        g = g * clip
    elif HAS_CLIP == CLIP_VALUE:
        bound = as_stored(clip, g_ptr.dtype.element_ty)
        g = tl.where(g < -bound, -bound, g)
        g = tl.where(g > bound, bound, g)
    if HAS_SCALE or HAS_CLIP != CLIP_NONE:
        store(g_ptr, offs, n, g, MASKED)
    return tl.where(maximize, -g, g)


@triton.jit
def load_opt(ptr, offs, n, FLAG: tl.constexpr, MASKED: tl.constexpr):
    """:func:`load` of an operand that a constexpr may leave out (then nothing is read)."""
    if FLAG:
        x = load(ptr, offs, n, MASKED)
    else:
        x = 0.0
    return x


@triton.jit
def lerp(a, b, w):
    """torch.lerp(a, b, w) with its two formulas (a + w (b - a) below w = 0.5, b - (b - a)(1 - w)
    from 0.5 on), so results agree with torch on both sides of the switch."""
    d = b - a
    return tl.where(w < 0.5, a + w * d, b - d * (1.0 - w))


@triton.jit
def as_stored(x, DT: tl.constexpr):
    """float32 ``x`` as it reads back after a store to ``DT`` (rounded to nearest even)."""
    if DT == tl.float32:
        y = x
    elif _INTERPRET and DT == tl.bfloat16:
        y = round_bf16_rne(x)
    else:
        y = x.to(DT).to(tl.float32)
    return y


@triton.jit
def ema_fold(e_ptr, offs, n, e, w, ema_w, STATE_DT: tl.constexpr, EMA: tl.constexpr,
             MASKED: tl.constexpr):
    """ema = lerp(ema, new weight as stored in ``STATE_DT``, ema_w), folded into the update that
    produced the weight (what ModelEMA.update computes after the step, without reading it again)."""
    if EMA:
        store(e_ptr, offs, n, lerp(e, as_stored(w, STATE_DT), ema_w), MASKED)


@triton.jit
def ema_chunk(row, start, n, ema_w, SRC: tl.constexpr, STATE_DT: tl.constexpr, EMA_DT: tl.constexpr,
              BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    """ema = lerp(ema, operand SRC, ema_w) over one work item (FusedEMA, buffers, skipped steps)."""
    offs = tl.arange(0, BLOCK)
    s_ptr = operand(row, SRC, start, STATE_DT, ALIGNED)
    e_ptr = operand(row, OP_EMA, start, EMA_DT, ALIGNED)
    s = load(s_ptr, offs, n, MASKED)
    e = load(e_ptr, offs, n, MASKED)
    for b in tl.static_range(NB):
        o = offs + b * BLOCK
        if b + 1 < NB:
            s_next = load(s_ptr, o + BLOCK, n, MASKED)
            e_next = load(e_ptr, o + BLOCK, n, MASKED)
        store(e_ptr, o, n, lerp(e, s, ema_w), MASKED)
        if b + 1 < NB:
            s, e = s_next, e_next


# ---- the launch body ---------------------------------------------------------------------------
# not inlined: Triton's coalescing pass costs the square of a function's memory operations, and
# one function per arm (row code, masked or not) made the H200's compile of the trainer's
# AdamW + EMA update 10.4 s instead of about a third of it; ptxas inlines the calls again (same
# registers, no stack frame)
@triton.jit(noinline=True)
def _arm_typed(chunk_fn, row, r, hp, arrivals, start, n, scale, clip, ema_w, ok,
               C: tl.constexpr, PARAM_DT: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
               MASKED: tl.constexpr, ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr,
               HAS_CLIP: tl.constexpr, WIDTH: tl.constexpr, WIDE16: tl.constexpr):
    MASTER: tl.constexpr = (CODE_MASTER & C) != 0
    EMA: tl.constexpr = (CODE_EMA & C) != 0
    STATE_DT: tl.constexpr = tl.float32 if MASTER else PARAM_DT
    EMA_DT: tl.constexpr = PARAM_DT if (CODE_EMA_LOW & C) != 0 else tl.float32
    # WIDE16 gives rows of 16-bit tensors blocks twice as long (same work item), so each thread
    # still moves 16 bytes per access
    HALF: tl.constexpr = 2 if WIDE16 and NB % 2 == 0 and STATE_DT != tl.float32 else 1
    if (CODE_EMA_ONLY & C) != 0:
        ema_chunk(row, start, n, ema_w, OP_PARAM, PARAM_DT, EMA_DT, BLOCK, NB, MASKED, ALIGNED)
    else:
        if ok:
            chunk_fn(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT, STATE_DT, EMA_DT,
                     MASTER, EMA,
                     BLOCK * HALF, NB // HALF, MASKED, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH)
        elif EMA:  # a skipped step still moves the EMA toward the (unchanged) weight
            if MASTER:
                ema_chunk(row, start, n, ema_w, OP_MASTER, tl.float32, EMA_DT, BLOCK, NB, MASKED,
                          ALIGNED)
            else:
                ema_chunk(row, start, n, ema_w, OP_PARAM, PARAM_DT, EMA_DT, BLOCK, NB, MASKED, ALIGNED)


@triton.jit
def _arm(chunk_fn, row, r, hp, arrivals, start, n, scale, clip, ema_w, ok, C: tl.constexpr,
         BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
         HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, WIDTH: tl.constexpr,
         WIDE16: tl.constexpr):
    if C % 4 == 0:
        _arm_typed(chunk_fn, row, r, hp, arrivals, start, n, scale, clip, ema_w, ok, C,
                   tl.float32, BLOCK, NB, MASKED, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH, WIDE16)
    elif C % 4 == 1:
        _arm_typed(chunk_fn, row, r, hp, arrivals, start, n, scale, clip, ema_w, ok, C,
                   tl.bfloat16, BLOCK, NB, MASKED, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH, WIDE16)
    else:
        _arm_typed(chunk_fn, row, r, hp, arrivals, start, n, scale, clip, ema_w, ok, C,
                   tl.float16, BLOCK, NB, MASKED, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH, WIDE16)


@triton.jit
def run(chunk_fn, rows, chunks, hp, arrivals, scale_ptr, clip_ptr, inf_ptr, ema_w,
        BLOCK: tl.constexpr, NB: tl.constexpr, CODES: tl.constexpr, ALIGNED: tl.constexpr,
        HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_INF: tl.constexpr,
        WIDTH: tl.constexpr, WIDE16: tl.constexpr):
    """The body of every multi-tensor update: find this program's work item and hand it to the
    client's ``chunk_fn`` with the operand dtypes as constexprs (one arm per row code present in
    ``CODES``). On inf/NaN (GradScaler's ``found_inf``) the update is skipped; EMA rows still move.

    The chunk-function contract, the one every client kernel implements::

        chunk_fn(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT, STATE_DT, EMA_DT,
                 MASTER, EMA, BLOCK, NB, MASKED, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH)

    updates ``n`` (<= BLOCK * NB) elements of the tensor in ``row`` from ``start``: PARAM_DT is the
    param/grad dtype, STATE_DT the dtype of the weight it does math on and of the states, EMA_DT
    the EMA's. HAS_CLIP is CLIP_NONE, CLIP_NORM (``clip`` is a coefficient) or CLIP_VALUE (``clip``
    is the clamp bound), both applied by :func:`grad_in`. MASKED is False for full chunks, whose
    accesses then vectorize. A client that needs only part of it (clipping's scaling) ignores the
    rest: Triton has no way to pass a subset.
    """
    r, row, start, n = work_item(chunks, rows, BLOCK * NB)
    ok = live(inf_ptr, HAS_INF)
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = 1.0
    if HAS_CLIP != CLIP_NONE:
        clip = tl.load(clip_ptr).to(tl.float32)
    else:
        clip = 1.0
    code = tl.load(row + COL_CODE)
    for c in tl.static_range(NCODES):
        if (CODES >> c) & 1:
            if code == c:
                if n == BLOCK * NB:
                    _arm(chunk_fn, row, r, hp, arrivals, start, n, scale, clip, ema_w, ok, c,
                         BLOCK, NB, False, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH, WIDE16)
                else:
                    _arm(chunk_fn, row, r, hp, arrivals, start, n, scale, clip, ema_w, ok, c,
                         BLOCK, NB, True, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH, WIDE16)


@triton.jit
def pow_f64(base, step):
    """base ** step for a float64 base and an integer-valued step, by repeated squaring: exact to a
    few ulps of float64 where exp2(step * log2(base)) in float32 would lose 1e-4 of 1 - beta2**1."""
    e = step.to(tl.int64)
    result = base * 0.0 + 1.0
    b = base
    while e > 0:
        if e % 2 == 1:
            result = result * b
        b = b * b
        e = e // 2
    return result


@triton.jit
def update_kernel(rows, chunks, hp, arrivals, scale_ptr, clip_ptr, inf_ptr, ema_w,
                  BLOCK: tl.constexpr, NB: tl.constexpr, CODES: tl.constexpr, ALIGNED: tl.constexpr,
                  HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_INF: tl.constexpr,
                  WIDTH: tl.constexpr, WIDE16: tl.constexpr, CHUNK_FN: tl.constexpr, EMA_PTR: tl.constexpr):
    """The one multi-tensor launch: :func:`run` with the client's ``CHUNK_FN`` (the optimizers'
    updates, clipping's scaling; FusedEMA passes :func:`ema_chunk`, whose rows are all EMA_ONLY, so
    no update arm is ever instantiated). ``ema_w``: the EMA weight, or with ``EMA_PTR`` a pointer
    to it (a float32 in device memory, written before the launch: a launch captured in a CUDA graph
    then reads each replay's weight)."""
    if EMA_PTR:
        w = tl.load(ema_w)
    else:
        w = ema_w
    run(CHUNK_FN, rows, chunks, hp, arrivals, scale_ptr, clip_ptr, inf_ptr, w, BLOCK, NB,
        CODES, ALIGNED, HAS_SCALE, HAS_CLIP, HAS_INF, WIDTH, WIDE16)
