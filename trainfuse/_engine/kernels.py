"""Triton building blocks shared by every multi-tensor kernel (optimizers, EMA, clipping).

A launch walks *work items*: one program per (tensor, chunk of ``NB`` blocks of ``BLOCK`` elements;
each program loads block b + 1 before it computes and stores block b, so the scalar work of a
program and the latency of its loads overlap). The host side (``table.py``) writes
two int64 tables on the device:

- ``rows[t, :]`` — one row per tensor: operand addresses, numel, group, dtype code, step address.
- ``chunks[pid]`` — ``(t << 32) | chunk`` for program ``pid``.

Each client kernel reads its work item with :func:`work_item`, its hyperparameters from a float64
per-group table, and applies its own elementwise math with :func:`load` / :func:`store`.
"""

import os

import triton
import triton.language as tl

ROW = tl.constexpr(16)  # int64 columns per tensor row; 16 keeps the chunk table 128-byte aligned
COL_OPERAND0 = tl.constexpr(0)  # operands 0..5: param, grad, up to four state tensors
COL_STEP = tl.constexpr(6)  # address of the tensor's float32 step counter
COL_NUMEL = tl.constexpr(7)
COL_GROUP = tl.constexpr(8)
COL_DTYPE = tl.constexpr(9)  # 0 float32, 1 bfloat16, 2 float16
COL_NCHUNKS = tl.constexpr(10)

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
    if ALIGNED:
        addr = tl.multiple_of(addr, 16)
    return addr.to(tl.pointer_type(DT)) + start


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
def _round_bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def store(ptr, offs, n, x, MASKED: tl.constexpr):
    """Store float32 ``x`` rounded to the operand's dtype (round to nearest even)."""
    ty = ptr.dtype.element_ty
    if _INTERPRET:
        if ty == tl.bfloat16:
            x = _round_bf16_rne(x)
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
            x = _round_bf16_rne(x)
    tl.store(ptr + offs, x.to(ty), mask=_optional_mask(offs, n, flag, MASKED))


@triton.jit
def live(inf_ptr, HAS_INF: tl.constexpr):
    """False when GradScaler found an inf/NaN: the whole step is then skipped."""
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


@triton.jit
def _dispatch(chunk_fn, row, r, hp, arrivals, start, n, scale, BLOCK: tl.constexpr,
              NB: tl.constexpr, DTYPES: tl.constexpr, MASKED: tl.constexpr,
              ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr, WIDTH: tl.constexpr,
              WIDE16: tl.constexpr):
    # one arm per dtype present in the launch (DTYPES bit mask); WIDE16 gives 16-bit tensors
    # blocks twice as long (same work item) so each thread still moves 16 bytes per access
    HALF: tl.constexpr = 2 if WIDE16 and NB % 2 == 0 else 1
    code = tl.load(row + COL_DTYPE)
    if DTYPES & 1:
        if code == 0:
            chunk_fn(row, r, hp, arrivals, start, n, scale, tl.float32, BLOCK, NB, MASKED, ALIGNED,
                     HAS_SCALE, WIDTH)
    if DTYPES & 2:
        if code == 1:
            chunk_fn(row, r, hp, arrivals, start, n, scale, tl.bfloat16, BLOCK * HALF, NB // HALF,
                     MASKED, ALIGNED, HAS_SCALE, WIDTH)
    if DTYPES & 4:
        if code == 2:
            chunk_fn(row, r, hp, arrivals, start, n, scale, tl.float16, BLOCK * HALF, NB // HALF,
                     MASKED, ALIGNED, HAS_SCALE, WIDTH)


@triton.jit
def run(chunk_fn, rows, chunks, hp, arrivals, scale_ptr, inf_ptr, BLOCK: tl.constexpr,
        NB: tl.constexpr, DTYPES: tl.constexpr, ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr,
        HAS_INF: tl.constexpr, WIDTH: tl.constexpr, WIDE16: tl.constexpr):
    """The body of every multi-tensor kernel: find this program's work item, skip everything on
    inf/NaN, and hand the chunk to the client's ``chunk_fn`` with the operand dtype as constexpr.

    ``chunk_fn(row, r, hp, arrivals, start, n, scale, DT, BLOCK, NB, MASKED, ALIGNED, HAS_SCALE,
    WIDTH)`` processes ``n`` (<= BLOCK * NB) elements from ``start``; MASKED is False for full chunks
    so their accesses need no mask and vectorize.
    """
    r, row, start, n = work_item(chunks, rows, BLOCK * NB)
    if live(inf_ptr, HAS_INF):
        if HAS_SCALE:
            scale = tl.load(scale_ptr).to(tl.float32)
        else:
            scale = 1.0
        if n == BLOCK * NB:
            _dispatch(chunk_fn, row, r, hp, arrivals, start, n, scale, BLOCK, NB, DTYPES, False,
                      ALIGNED, HAS_SCALE, WIDTH, WIDE16)
        else:
            _dispatch(chunk_fn, row, r, hp, arrivals, start, n, scale, BLOCK, NB, DTYPES, True,
                      ALIGNED, HAS_SCALE, WIDTH, WIDE16)


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
