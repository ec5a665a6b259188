"""Linear + bias + activation (+ dropout) chains: one Triton matmul per layer and direction.

For layer ``i`` with weight ``W_i`` (out x in), input ``X_i`` and activation ``f``::

    forward  pre_i = X_i W_i^T + b_i                     matmul, bias in the epilogue
             X_{i+1} = dropout(f(pre_i))                 activation and dropout in the epilogue
    dgrad    dpre_{i-1} = (dpre_i W_i) * f'(.) * keep/(1-p)   the previous layer's activation grad
                                                        (and dropout mask) in the epilogue
    wgrad    dW_i = dpre_i^T X_i,  db_i = sum_rows dpre_i  the bias grad as a second MMA of the
                                                        dpre_i^T tiles with ones, deterministically

One kernel, :func:`_mm_kernel`, does all three: its operands are addressed by strides, so ``W^T``
and ``dpre^T`` are read in place (through TMA tensor descriptors, or pointers where the launch
shape says so or the layout does not allow TMA), and its ``EPI`` constexpr picks the epilogue.
Weights are read as they are stored (a float32 weight under bf16 autocast) and converted to the
compute dtype in registers, so no weight-cast kernel runs; accumulation is float32. The chain's
input is the exception: it is cast once, as autocast would, because two matmuls read it (the
first layer's forward and weight grad), and each ran 1.6-3x slower reading float32 rows than
16-bit ones (B=2048, D=4096 on an H200: 320 and 327 us against 106 and 131 us for the other
layers' forward and weight grad; the cast takes about 12 us). The weight grad goes straight into
the weight's dtype (float32 for float32 params: torch rounds it through bf16 under autocast first).

What the forward saves: every layer's input (the next layer's wgrad needs it anyway), and for
GELU/SiLU the activation's derivative ``f'(pre)``, computed in float32 beside ``f(pre)`` (they
share the erf / tanh / sigmoid) and rounded to the compute dtype: the input grad's epilogue then
multiplies instead of evaluating erf and exp for each of the 128 accumulator elements a thread
holds, which had made it 80 us against ReLU's 44.5 us (B=8192, D=1024, H200). Torch saves the
rounded pre-activation and differentiates that; the two differ by one rounding of ``f'``.
ReLU needs nothing more: its mask is ``out > 0``. Dropout draws its mask from Philox
(``tl.rand(seed, element index)``) and nothing stores it: the backward reads it back from what
the forward saves anyway (ReLU's output is zero where dropped; GELU/SiLU's derivative is stored
times the mask and the scale), and draws it again from the seed only where no activation saved
anything.

The backward runs each layer's wgrad on a side CUDA stream (``streams=2``), so it overlaps the
next dgrad on the main stream. The side stream waits on the main one before each wgrad; every
tensor it reads stays referenced until the main stream has joined it, at the end of the backward,
so the caching allocator cannot hand their memory to another kernel while the side stream still
reads it; the weight grads reach ``.grad`` or autograd only after that join (DDP's hooks,
GradScaler and CUDA-graph capture see an ordinary single-stream backward).

Param grads: where autograd's AccumulateGrad would assign or add them and nothing could tell the
difference (:func:`_direct_grads`), the backward writes them into ``.grad`` itself, and onto an
existing grad the weight-grad kernel starts its accumulator from the grad's tile (``ACCUM``): no
add kernel per param. Elsewhere they go back to autograd as any Function's would.

Host time: after its first call a chain launches from sites bound to its signature
(:class:`_Slot`), and those record their launches instead of making them; the forward and the
one-stream backward each end by replaying their list as one CUDA graph where the same list was
captured before (:func:`trainfuse._runtime.launch.finish_recording`). Equal lists are equal
launches, so nothing but the host time changes.

Two launch choices here avoid wrong results that triton 3.6's software pipelining gave on Hopper
(not reproducible on CPU: the interpreter does not pipeline), and GPU tests at the benchmark's
shapes guard both: the bias grad is not summed in registers from the MMA's A tile (:func:`_mma`),
and a float32 weight read transposed (the input grad) goes through TMA, or through pointers in at
most 2 stages (:func:`_rounds_weight_transposed`).

The reference is ``torch.nn.Sequential(Linear, activation, Dropout, ...)``: :func:`mlp_reference`
runs the same chain in torch, optionally with our dropout mask.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import triton
import triton.language as tl

from trainfuse._runtime.backend import interpreting
from trainfuse._runtime.launch import (
    CachedLauncher,
    Compiled,
    Replays,
    drop_recording,
    ensure_allocator,
    finish_recording,
    interrupt_recording,
    recording,
    sm_count,
    start_recording,
    stream_workspace,
    stream_workspace_fits,
)

launcher = CachedLauncher()

ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}
_DERIV_SAVED = (2, 3, 4)  # the activations whose derivative the forward saves for the backward
_RELU = tl.constexpr(1)
_GELU = tl.constexpr(2)
_GELU_TANH = tl.constexpr(3)
_SILU = tl.constexpr(4)

# epilogues of _mm_kernel
EPI_FORWARD = 0  # + bias, activation, dropout; optionally store the activation's derivative
EPI_ACT_GRAD = 1  # times the activation grad of the saved tensor, and the dropout mask
EPI_PLAIN = 2  # store as is (dgrad of the first layer, or of a layer with nothing to undo)
EPI_WGRAD = 3  # weight grad (+ bias grad: row sums of A), split over K when K is long; ACCUM adds to C

# the same numbers as constexprs, for the kernels (a jit function reads no other globals)
_EPI_FORWARD = tl.constexpr(EPI_FORWARD)
_EPI_ACT_GRAD = tl.constexpr(EPI_ACT_GRAD)
_EPI_WGRAD = tl.constexpr(EPI_WGRAD)
ROWSUM_N = tl.constexpr(16)  # columns of the bias grad's MMA (the narrowest tensor-core tile: n = 8 or 16)

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_TANH_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi), GELU's tanh approximation
_TANH_K = tl.constexpr(0.044715)


# ---- activations --------------------------------------------------------------------------------
@triton.jit
def _tanh(u):
    # from exp: no libdevice, so the same code runs in the interpreter; 1 - 2 / (e^2u + 1) is exact
    # at +-inf and within 1e-7 absolute near 0 (GELU multiplies it by x / 2)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _act_deriv(x, ACT: tl.constexpr):
    """(f(x), f'(x)) in float32 for GELU / GELU(approximate="tanh") / SiLU, sharing their erf,
    tanh or sigmoid: the forward's output and, when it saves it, the backward's derivative."""
    if ACT == _GELU:
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
        return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    elif ACT == _GELU_TANH:
        x2 = x * x
        t = _tanh((x + x2 * x * _TANH_K) * _TANH_C)
        return (0.5 * x * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (1.0 + x2 * (3.0 * _TANH_K)) * _TANH_C)
    else:
        s = _sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s))


@triton.jit
def _act(x, ACT: tl.constexpr):
    """f(x) in float32, as torch's ReLU / GELU / GELU(approximate="tanh") / SiLU compute it."""
    if ACT == _RELU:
        return tl.where(x < 0.0, 0.0, x)  # NaN stays NaN, as in torch.relu
    elif ACT == 0:
        return x
    else:
        f, _ = _act_deriv(x, ACT)  # one formula for f: the compiler drops the unused derivative
        return f


@triton.jit
def _act_grad(g, saved, ACT: tl.constexpr):
    """g * f'(.) where ``saved`` is the output for ReLU and f'(pre-activation) otherwise."""
    if ACT == _RELU:
        return tl.where(saved > 0.0, g, 0.0)  # torch's threshold_backward on the output
    elif ACT == 0:
        return g
    else:
        return g * saved


@triton.jit
def _undo_act(g, saved, scale, ACT: tl.constexpr, DROP: tl.constexpr):
    """g * f'(pre) * keep / (1 - p) from what the forward saved, without drawing the dropout mask
    again: ReLU's saved output is > 0 only where kept (so only the scale is left to apply), and
    GELU/SiLU's saved derivative was stored times the mask and the scale. (With no activation the
    caller draws the mask again from the seed.)"""
    g = _act_grad(g, saved, ACT)
    if DROP and ACT == _RELU:
        g = g * scale
    return g


@triton.jit
def _keep(seed, idx, p):
    """Dropout's keep mask for element index ``idx`` (row * cols + col): Philox, so forward and
    backward draw the same mask from the seed alone."""
    return tl.rand(seed, idx) >= p


# ---- the matmul -----------------------------------------------------------------------------------
@triton.jit
def _to(v, dtype: tl.constexpr, RNE: tl.constexpr):
    """``v.to(dtype)``. With ``RNE`` (set under the interpreter, whose float32 -> bfloat16
    conversion rounds toward zero up to triton 3.9) a bfloat16 result is first rounded to nearest
    even in float32, as the GPU rounds, so that the interpreter tests check the GPU's numerics."""
    if RNE:
        if dtype == tl.bfloat16:
            bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _mma(a, b, acc, rowsum, ROWSUM: tl.constexpr, CD: tl.constexpr, PREC: tl.constexpr,
         UPCAST: tl.constexpr):
    """``acc += a @ b``; with ``ROWSUM`` also ``rowsum += a @ ones`` (the bias grad: rows of
    A = dpre^T summed over the batch, as read; ``rowsum`` is ``[BM, ROWSUM_N]``, every column
    the same sum). The row sums run on the tensor cores too: summed in registers instead
    (``tl.sum`` of the tile), triton 3.6 gave A's tiles one pipeline stage fewer than B's while
    the asynchronous MMA still read them, and the weight grad of the tiles that sum the bias
    came out wrong (H200, float32 grad 4096 x 4096 at K=2048: every run)."""
    if UPCAST:
        # the interpreter (triton <= 3.9) returns garbage for a bfloat16 tl.dot: round the
        # operands to the compute dtype, then multiply them in float32 (the same products)
        a32 = _to(a, CD, True).to(tl.float32)
        acc = tl.dot(a32, _to(b, CD, True).to(tl.float32), acc, input_precision="ieee")
        if ROWSUM:
            ones = tl.full((a.shape[1], ROWSUM_N), 1.0, tl.float32)
            rowsum = tl.dot(a32, ones, rowsum, input_precision="ieee")
    else:
        a16 = a.to(CD)
        acc = tl.dot(a16, b.to(CD), acc, input_precision=PREC)
        if ROWSUM:
            rowsum = tl.dot(a16, tl.full((a.shape[1], ROWSUM_N), 1.0, CD), rowsum, input_precision=PREC)
    return acc, rowsum


@triton.jit
def _mainloop(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, off_m, off_n, k0, k_end, acc, rowsum,
              ROWSUM: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, CD: tl.constexpr,
              PREC: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
    """acc += A[off_m:off_m + BM, k0:k_end] @ B[k0:k_end, off_n:off_n + BN].

    With ``TMA`` the tiles come through tensor descriptors of the operands as stored (``A_T``: A
    is the transpose of a row-major matrix, so its tiles are loaded as [BK, BM] and transposed in
    shared memory; likewise ``B_T``), which also zero-fill past the edges; otherwise through
    pointers, rows and columns past the edge wrapping around (their results are never stored) so
    that only K needs a mask."""
    if TMA:
        if A_T:
            a_desc = tl.make_tensor_descriptor(a_ptr, [K, M], [s_ak, 1], [BK, BM])
        else:
            a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [s_am, 1], [BM, BK])
        if B_T:
            b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [s_bn, 1], [BN, BK])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [s_bk, 1], [BK, BN])
        for k in range(k0, k_end, BK):
            if A_T:
                a = a_desc.load([k, off_m]).T
            else:
                a = a_desc.load([off_m, k])
            if B_T:
                b = b_desc.load([off_n, k]).T
            else:
                b = b_desc.load([k, off_n])
            acc, rowsum = _mma(a, b, acc, rowsum, ROWSUM, CD, PREC, UPCAST)
    else:
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        ram = rm if EVEN_M else rm % M
        rbn = rn if EVEN_N else rn % N
        rk = k0 + tl.arange(0, BK)
        a_ptrs = a_ptr + ram[:, None].to(tl.int64) * s_am + rk[None, :].to(tl.int64) * s_ak
        b_ptrs = b_ptr + rk[:, None].to(tl.int64) * s_bk + rbn[None, :].to(tl.int64) * s_bn
        for k in range(k0, k_end, BK):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                inside = k + tl.arange(0, BK) < k_end
                a = tl.load(a_ptrs, mask=inside[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=inside[:, None], other=0.0)
            acc, rowsum = _mma(a, b, acc, rowsum, ROWSUM, CD, PREC, UPCAST)
            a_ptrs += BK * s_ak
            b_ptrs += BK * s_bk
    return acc, rowsum


@triton.jit
def _tile_store(ptr, v, mask, FULL: tl.constexpr, RNE: tl.constexpr):
    """Store a C-shaped tile; ``FULL`` (the tile lies inside C: M and N are multiples of the tile)
    drops the mask, whose per-element test of the unspecialized M and N otherwise keeps every
    store scalar (one 2-byte st.global per element); ``RNE``: see :func:`_to`."""
    if FULL:
        tl.store(ptr, _to(v, ptr.dtype.element_ty, RNE))
    else:
        tl.store(ptr, _to(v, ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _tile_load(ptr, mask, FULL: tl.constexpr):
    if FULL:
        return tl.load(ptr).to(tl.float32)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


# sizes and the seed vary call to call: not specialized on (a kernel per divisibility class of
# each would multiply the compiles); strides stay specialized (== 1 and 16-byte alignment matter)
@triton.jit(do_not_specialize=["M", "N", "K", "k_split", "nsplit", "d_m", "d_n", "seed"])
def _mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, aux_ptr, pre_ptr, db_ptr, ws_ptr, cnt_ptr,
               M, N, K, k_split, nsplit, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_xm, s_xn, d_m, d_n,
               seed, p, scale,
               EPI: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROWS: tl.constexpr,
               STORE_PRE: tl.constexpr, DROP: tl.constexpr, SPLIT_K: tl.constexpr, ACCUM: tl.constexpr,
               CD: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
               EVEN_K: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """``C[M, N] = A[M, K] @ B[K, N]`` then the ``EPI`` epilogue. Every operand is addressed by
    strides: A and B in any layout and float dtype (converted to ``CD`` in registers), C, ``aux``
    (the saved activation) and ``pre`` as views, so a caller may compute ``C^T = B^T A^T`` into
    a transposed view (the weight as A, whose conversion then stays in registers). The bias is
    per column (per row with ``BIAS_ROWS``); the dropout element index is ``row * d_m + col * d_n``
    (the index in the layer's own row-major output). For ``EPI_WGRAD`` with ``SPLIT_K`` program
    ``tile * nsplit + s`` covers ``K`` range ``s``; the last of a tile's programs to finish adds
    the ``nsplit`` partials in order (deterministic) and writes C. With ``ACCUM`` the weight and
    bias grads are added to what C and ``db`` hold (a param's existing .grad, accumulated in place
    as autograd would, with no add kernel): the accumulator starts from C's tile, or the split-K
    reduction adds it to the partials' sum. (Adding C after the main loop, when the accumulator
    holds all its registers, spilled: H200, 4096 x 4096 float32 grad at K=2048, 173 us against
    159, and 133 for a plain store.)"""
    pid = tl.program_id(0)
    tile = pid // nsplit
    split = pid % nsplit
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    # groups of GROUP_M row tiles walk the column tiles together: their A rows and B columns
    # stay in L2 while the group runs
    width = GROUP_M * tiles_n
    first_m = (tile // width) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % rows_in_group
    pid_n = (tile % width) // rows_in_group
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    k0 = tl.multiple_of(split * k_split, BK)  # k_split is a multiple of BK: aligned, vector loads
    k_end = tl.minimum(K, k0 + k_split)
    acc = tl.zeros((BM, BN), tl.float32)
    if ACCUM and not SPLIT_K:  # offsets made here, not kept: live through the loop they cost registers
        acc = _tile_load(c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :].to(tl.int64) * s_cn,
                         (rm < M)[:, None] & (rn < N)[None, :], EVEN_M and EVEN_N)
    rowsum = tl.zeros((BM, ROWSUM_N), tl.float32)
    ROWSUM: tl.constexpr = EPI == _EPI_WGRAD and HAS_BIAS
    if ROWSUM:
        if pid_n == 0:  # one column of tiles sums the bias grad; the others skip the row sums
            acc, rowsum = _mainloop(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, pid_m * BM, pid_n * BN,
                                    k0, k_end, acc, rowsum, True, TMA, A_T, B_T, EVEN_M, EVEN_N, EVEN_K,
                                    CD, PREC, UPCAST, BM, BN, BK)
        else:
            acc, rowsum = _mainloop(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, pid_m * BM, pid_n * BN,
                                    k0, k_end, acc, rowsum, False, TMA, A_T, B_T, EVEN_M, EVEN_N, EVEN_K,
                                    CD, PREC, UPCAST, BM, BN, BK)
    else:
        acc, rowsum = _mainloop(a_ptr, b_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, pid_m * BM, pid_n * BN,
                                k0, k_end, acc, rowsum, False, TMA, A_T, B_T, EVEN_M, EVEN_N, EVEN_K,
                                CD, PREC, UPCAST, BM, BN, BK)

    if ROWSUM:
        rowsum = tl.max(rowsum, 1)  # ROWSUM_N equal columns: any one of them
    in_m = rm < M
    mask = in_m[:, None] & (rn < N)[None, :]
    FULL: tl.constexpr = EVEN_M and EVEN_N
    c_off = rm[:, None].to(tl.int64) * s_cm + rn[None, :].to(tl.int64) * s_cn
    if EPI == _EPI_WGRAD:
        if SPLIT_K:
            part = ws_ptr + (tile * nsplit + split).to(tl.int64) * (BM * BN)
            t_off = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            tl.store(part + t_off, acc)
            db_ws = ws_ptr + tiles_m * tiles_n * nsplit * (BM * BN) + pid_m * nsplit * BM
            if ROWSUM:
                if pid_n == 0:
                    tl.store(db_ws + split * BM + tl.arange(0, BM), rowsum)
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == nsplit - 1:
                first = ws_ptr + (tile * nsplit).to(tl.int64) * (BM * BN)
                acc = tl.zeros((BM, BN), tl.float32)
                for j in range(nsplit):  # fixed order: the same sum whichever program came last
                    acc += tl.load(first + j * (BM * BN) + t_off, cache_modifier=".cg")
                if ACCUM:
                    acc += _tile_load(c_ptr + c_off, mask, FULL)
                _tile_store(c_ptr + c_off, acc, mask, FULL, UPCAST)
                if ROWSUM:
                    if pid_n == 0:
                        rowsum = tl.zeros((BM,), tl.float32)
                        for j in range(nsplit):
                            rowsum += tl.load(db_ws + j * BM + tl.arange(0, BM), cache_modifier=".cg")
                        if ACCUM:
                            rowsum += tl.load(db_ptr + rm, mask=in_m, other=0.0).to(tl.float32)
                        tl.store(db_ptr + rm, _to(rowsum, db_ptr.dtype.element_ty, UPCAST), mask=in_m)
                tl.store(cnt_ptr + tile, 0)  # re-armed for the next launch on this stream
        else:
            _tile_store(c_ptr + c_off, acc, mask, FULL, UPCAST)
            if ROWSUM:
                if pid_n == 0:
                    if ACCUM:
                        rowsum += tl.load(db_ptr + rm, mask=in_m, other=0.0).to(tl.float32)
                    tl.store(db_ptr + rm, _to(rowsum, db_ptr.dtype.element_ty, UPCAST), mask=in_m)
    else:
        v = acc
        x_off = rm[:, None].to(tl.int64) * s_xm + rn[None, :].to(tl.int64) * s_xn
        if EPI == _EPI_FORWARD:
            if HAS_BIAS:
                if BIAS_ROWS:
                    v += tl.load(bias_ptr + rm, mask=in_m, other=0.0).to(tl.float32)[:, None]
                else:
                    v += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if DROP:
                keep = _keep(seed, rm[:, None] * d_m + rn[None, :] * d_n, p)
            if STORE_PRE:  # f' for the backward, beside f (and times the mask: see _undo_act)
                v, deriv = _act_deriv(v, ACT)
                if DROP:
                    deriv = tl.where(keep, deriv * scale, 0.0)
                _tile_store(pre_ptr + x_off, deriv, mask, FULL, UPCAST)
            else:
                v = _act(v, ACT)
            if DROP:
                v = tl.where(keep, v * scale, 0.0)
        elif EPI == _EPI_ACT_GRAD:
            if ACT != 0:
                v = _undo_act(v, _tile_load(aux_ptr + x_off, mask, FULL), scale, ACT, DROP)
            elif DROP:
                keep = _keep(seed, rm[:, None] * d_m + rn[None, :] * d_n, p)
                v = tl.where(keep, v * scale, 0.0)
        _tile_store(c_ptr + c_off, v, mask, FULL, UPCAST)


@triton.jit(do_not_specialize=["seed"])
def _act_grad_kernel(g_ptr, aux_ptr, out_ptr, n, seed, p, scale, ACT: tl.constexpr,
                     DROP: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr):
    """The last layer's activation (and dropout) grad, elementwise: its upstream grad comes from
    outside the chain, so no matmul of ours can take it in an epilogue."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT != 0:
        v = _undo_act(v, tl.load(aux_ptr + offs, mask=mask, other=0.0).to(tl.float32), scale, ACT, DROP)
    elif DROP:
        v = tl.where(_keep(seed, offs.to(tl.int32), p), v * scale, 0.0)
    tl.store(out_ptr + offs, _to(v, out_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _mask_kernel(out_ptr, n, seed, p, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _keep(seed, offs, p).to(tl.int8), mask=offs < n)


# ---- launch shapes ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tile shape of one matmul launch. ``stages`` is the software-pipelining depth; the
    interpreter tests shrink the tiles so that small problems still span several programs."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = 8
    tma: bool = True  # operand tiles through TMA tensor descriptors where the layout allows


_serials = itertools.count()


@dataclasses.dataclass
class MatmulConfigs:
    """The launch shapes of the three matmuls of a layer and how the weight grad splits. Every
    assignment gives the object a new ``serial``: cached launch plans are keyed on it."""

    # a fixed launch shape per matmul, or None: :func:`default_tile` picks one per problem
    forward: MatmulConfig | None = None
    dgrad: MatmulConfig | None = None
    wgrad: MatmulConfig | None = None
    # wgrad: split the batch (its K) until about ``wave_programs`` programs per SM run, but keep at
    # least ``min_split_k`` rows per split (short splits spend more on the partials than they save)
    # (sweep: 4 per SM and 2048 rows is the best measured at both B=8192 x 1024^2, where it splits
    # 4 ways, and B=65536 x 256^2, 32 ways; 64-way splits spent more on partials than they saved)
    wave_programs: int = 4
    min_split_k: int = 2048
    max_split: int = 64
    act_block: int = 2048
    # forward and dgrad as C^T = W X^T: the weight is the A operand, which the tensor cores can
    # take from registers, so a float32 weight converted there never goes back to shared memory
    # (None: whenever the compute dtype is 16-bit. A 16-bit weight gains too: a whole 4-layer
    # step, CUDA-graph timed on an H200, took 3-6 % less at D=1024 and D=4096, +0.3-0.9 % at D=256)
    weight_first: bool | None = None
    # False: operand tiles always through pointers (else as the launch shape says)
    tma: bool | None = None
    # replay a chain's forward and its one-stream backward as CUDA graphs once their launches
    # repeat (:func:`trainfuse._runtime.launch.finish_recording`); False launches each kernel every call
    graphs: bool = True

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value)
        if name not in ("serial", "graphs"):  # graphs changes no launch
            object.__setattr__(self, "serial", next(_serials))


config = MatmulConfigs()
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipeline stages may take (228 KB on Hopper)


def _rounds_weight_transposed(epi: int, converts: bool) -> bool:
    """The input grad of a float32 weight: it reads ``W^T`` and rounds it in registers. Through
    pointers in 3-stage pipelines triton 3.6 gave wrong tiles (H200, 65536 x 256: 8 launches in
    10; 8192 x 1024: 1 in 10; 128 x 128 tiles: nearly every launch); through TMA none in 30 (at
    +5 us a launch at D=256 and 1024, -8 us at D=4096), through pointers in 2 stages none in 18.
    :func:`default_tile` gives it TMA tiles; :func:`_make_plan` caps the stages where the layout
    keeps it on pointers."""
    return converts and epi != EPI_FORWARD


def default_tile(epi: int, M: int, N: int, K: int, cd: torch.dtype, converts: bool, drop: bool,
                 sms: int) -> MatmulConfig:
    """The launch shape for an (M, N, K) matmul in compute dtype ``cd`` (``converts``: one operand
    is a float32 weight rounded in registers; ``drop``: the epilogue draws a dropout mask).

    From ``python -m trainfuse.bench mlp --sweep`` (each matmul alone, CUDA-graph timed, H200,
    torch 2.11, triton 3.6) at the three benchmark shapes, and ptxas's register reports: 8 warps
    per 128-row tile (4 warps hold a 128 x 128 float32 accumulator in 128 registers a thread);
    128 x 256 tiles where the reduction is long, except under a dropout epilogue (the Philox
    state then spills); 64 x 128 tiles with TMA loads for short reductions (K = 256: more
    programs resident per SM, one's epilogue overlapping another's loads); weight grads in
    128 x 256 tiles when those alone fill the GPU twice, else 64 x 128 tiles split over the batch.

    A second sweep (each op alone at each of the three shapes, float32 and 16-bit weights) moved
    four choices:

    - input grads with a 16-bit weight: 128 x 256 tiles through TMA, 4 stages, wherever those
      fill the GPU once (time -5 % at D=1024, -9 to -17 % at D=4096, -16 % at D=256);
    - a float32 weight rounded in registers at a short reduction: 128 x 256 tiles through pointers
      where those fill the GPU (K = 256, 65536 rows: forward -41 %, input grad -24 %);
    - big weight grads: 16 row tiles per group, not 8 (-12 % at 4096^2 x 2048);
    - split weight grads: 3 pipeline stages, not 4 (-13 % at 1024^2 x 8192, equal at 256^2 x 65536).

    A third (the whole step timed in a CUDA graph per candidate): 16-bit weights at a short
    reduction take 128 x 128 pointer tiles for the forward and input grad where those fill the GPU
    (K = 256, 65536 rows, bf16 params: step -14 %; float32 weights keep their own choice).
    """
    if cd == torch.float32:  # float32 operands: twice the shared memory per stage
        return MatmulConfig(128, 128, 32, 8, 3)
    if epi == EPI_WGRAD:
        if -(-M // 128) * -(-N // 256) >= 2 * sms:
            return MatmulConfig(128, 256, 64, 8, 3, group_m=16)
        return MatmulConfig(64, 128, 64, 4, 3)
    if _rounds_weight_transposed(epi, converts):  # TMA tiles: see there
        return MatmulConfig(128, 128, 64, 8, 3) if drop else MatmulConfig(128, 256, 64, 8, 3)
    if drop:
        return MatmulConfig(64, 128, 64, 4, 4) if K < 512 else MatmulConfig(128, 128, 64, 8, 3, tma=False)
    fills = -(-M // 128) * -(-N // 256) >= sms  # 128 x 256 tiles fill the GPU at least once
    if K < 512 and not converts and fills:
        return MatmulConfig(128, 128, 64, 8, 3, tma=False)
    if epi != EPI_FORWARD and not converts and fills:
        return MatmulConfig(128, 256, 64, 8, 4)
    if K < 512 and not (converts and fills):
        return MatmulConfig(64, 128, 64, 4, 4)
    if epi == EPI_FORWARD and not converts:
        return MatmulConfig(128, 128, 64, 8, 3, tma=False)
    return MatmulConfig(128, 256, 64, 8, 3, tma=False)


def _stages(cfg: MatmulConfig, a: torch.Tensor, b: torch.Tensor) -> int:
    """Fewer stages when a float32 operand (read as stored, converted in registers) doubles a
    stage's shared memory."""
    per_stage = cfg.bk * (cfg.bm * a.element_size() + cfg.bn * b.element_size())
    return max(2, min(cfg.stages, _SMEM_BUDGET // per_stage))


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _precision(cd: torch.dtype) -> str:
    if cd != torch.float32 or (not interpreting() and torch.backends.cuda.matmul.allow_tf32):
        return "tf32"  # 16-bit operands ignore it; float32 follows torch's TF32 switch
    return "ieee"


@dataclasses.dataclass
class _Plan:
    """Everything about a matmul launch that follows from its signature (shapes, strides,
    dtypes, alignment, epilogue, launch shapes): worked out once, reused by every later call."""

    grid: tuple[int]
    ints: tuple[int, ...]
    split: int
    ws_floats: int
    tiles: int
    warps: int
    constexprs: dict


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _make_plan(a, b, c, x, cd, epi, act, has_bias, bias_rows, pre, drop, drop_index, accum) -> _Plan:
    M, K = a.shape
    N = b.shape[1]
    kind = config.wgrad if epi == EPI_WGRAD else config.dgrad if epi != EPI_FORWARD else config.forward
    sms = sm_count(a.device.index) if a.device.type == "cuda" else 4
    converts = cd != torch.float32 and torch.float32 in (a.dtype, b.dtype)
    if kind is None:
        kind = default_tile(epi, M, N, K, cd, converts, drop, sms)
    bm, bn, bk = kind.bm, kind.bn, kind.bk
    tiles = -(-M // bm) * -(-N // bn)
    split = 1
    if epi == EPI_WGRAD:
        target = sms * config.wave_programs
        split = max(1, min(config.max_split, target // tiles, K // config.min_split_k))
    k_split = -(-K // split)
    k_split = -(-k_split // bk) * bk
    split = max(1, -(-K // k_split))
    d_m, d_n = drop_index or (N, 1)
    a_t, b_t = _tma_layout(a), _tma_layout(b)
    tma = config.tma is not False and kind.tma and a_t is not None and b_t is not None
    stages = _stages(kind, a, b)
    if not tma and _rounds_weight_transposed(epi, converts):
        stages = min(stages, 2)  # a layout TMA cannot read: pointers, at most 2 stages (see there)
    ints = (M, N, K, k_split, split, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
            c.stride(1), x.stride(0), x.stride(1), d_m, d_n)
    constexprs = dict(
        EPI=epi, ACT=act, HAS_BIAS=has_bias, BIAS_ROWS=bias_rows, STORE_PRE=pre, DROP=drop,
        SPLIT_K=split > 1, ACCUM=accum, CD=_TL[cd], PREC=_precision(cd),
        UPCAST=interpreting() and cd == torch.bfloat16,
        EVEN_M=M % bm == 0, EVEN_N=N % bn == 0, EVEN_K=K % k_split == 0, TMA=tma, A_T=bool(a_t),
        B_T=bool(b_t), BM=bm, BN=bn, BK=bk,
        GROUP_M=kind.group_m, num_stages=stages)
    return _Plan((tiles * split,), ints, split, tiles * split * bm * bn + -(-M // bm) * split * bm, tiles,
                 kind.warps, constexprs)


def _drop_scale(p: float) -> float:
    """What dropout multiplies the kept elements by (the call's own ``p``: it is not part of the
    cached plan, so a changed ``Dropout.p`` takes effect at once)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _tma_layout(t: torch.Tensor) -> bool | None:
    """How a tensor descriptor can read the 2-d view ``t``: False when its rows are contiguous
    (row-major), True when its columns are (the transpose of a row-major matrix), None when
    neither, or the base or the row pitch is not 16-byte aligned (what TMA needs)."""
    if t.stride(1) == 1 or t.shape[1] == 1:
        pitch, transposed = t.stride(0), False
    elif t.stride(0) == 1 or t.shape[0] == 1:
        pitch, transposed = t.stride(1), True
    else:
        return None
    if t.data_ptr() % 16 or (pitch * t.element_size()) % 16:
        return None
    return transposed


def _carve(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Row-major tensors of ``shapes`` (1-d or 2-d) carved from one allocation, each starting
    128-byte aligned (TMA needs 16): one trip through the caching allocator instead of one per
    tensor (a CUDA ``torch.empty`` costs several microseconds of host time, a view about one)."""
    if not shapes:
        return []
    align = 128 // dtype.itemsize
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) // align) * align
    buf = torch.empty(total, dtype=dtype, device=device)
    return [buf.as_strided(shape, (shape[1], 1) if len(shape) == 2 else (1,), off)
            for shape, off in zip(shapes, offsets)]


def _alternating(shapes: list[tuple[int, int]], dtype: torch.dtype,
                 device: torch.device) -> list[torch.Tensor]:
    """Row-major 2-d tensors of ``shapes``, in the order they are written, each read only until
    the one after next is written (one stream's input grads: the input grad of layer ``i`` is read
    by layer ``i``'s weight and input grads, which run before layer ``i - 1`` writes): they take
    turns in two halves of one allocation, so the backward holds two such tensors at a time, as
    it did when each had its own allocation, freed once the next was made."""
    if not shapes:
        return []
    align = 128 // dtype.itemsize
    even = max(math.prod(s) for s in shapes[0::2])
    start = -(-even // align) * align
    odd = max((math.prod(s) for s in shapes[1::2]), default=0)
    buf = torch.empty(start + odd, dtype=dtype, device=device)
    return [buf.as_strided(s, (s[1], 1), 0 if j % 2 == 0 else start) for j, s in enumerate(shapes)]


class _Slot:
    """One launch site of a chain (a layer's forward, weight grad or input grad) under one chain
    signature (:func:`_chain_key`): once its plan and compiled kernel are known, later calls
    launch it straight through the kernel's launcher, with no per-launch keying. The chain
    signature fixes everything the launch's own key would hold (shapes, strides, dtypes,
    alignment, epilogue); only the tensors' addresses, the seed and ``p`` change call to call."""

    __slots__ = ("run", "grid", "ints", "split", "ws_floats", "tiles")

    def __init__(self) -> None:
        self.run = None

    def bind(self, compiled: Compiled, plan: _Plan) -> None:
        self.grid, self.ints = plan.grid[0], plan.ints
        self.split, self.ws_floats, self.tiles = plan.split, plan.ws_floats, plan.tiles
        self.run = compiled

    def bind_elementwise(self, compiled: Compiled, grid: int) -> None:
        """An elementwise kernel's site (:func:`act_grad`): only the kernel and its grid."""
        self.grid, self.ints, self.split = grid, (), 1
        self.run = compiled

    def launch(self, stream: int, a, b, c, bias, x, seed: int, p: float) -> None:
        """The bound launch on ``stream`` with the operands of :func:`matmul` (``bias`` and ``x``
        resolved as there). Only their addresses are read, so a caller may pass the tensors a
        transposed view was taken of and skip making the view. The launcher gets the addresses
        as ints: given a tensor it calls its ``data_ptr`` and asks the driver about the address,
        per pointer argument (H200 host: 12.5 against 11.3 us a launch)."""
        a_ = a.data_ptr()
        rec = recording.launches
        if self.split > 1:
            if rec is not None and not stream_workspace_fits(a.device, stream, torch.float32, self.ws_floats,
                                                             self.tiles):
                interrupt_recording()  # a new workspace: its zero fill must not pass the recorded
                rec = None
            ws, cnt = stream_workspace(a.device, stream, torch.float32, self.ws_floats, self.tiles)
            ws, cnt = ws.data_ptr(), cnt.data_ptr()
        else:
            ws = cnt = a_
        bias_, x_ = bias.data_ptr(), x.data_ptr()
        args = (a_, b.data_ptr(), c.data_ptr(), bias_, x_, x_, bias_, ws, cnt, *self.ints, seed, float(p),
                _drop_scale(p))
        if rec is not None:
            rec.append((self.run, self.grid, args))
        else:
            self.run(self.grid, stream, *args)


def _start_recording(stream: int, layers: list[Layer]) -> None:
    """Record a chain pass's launches for graph replay, unless ``config.graphs`` is off or a layer
    drops (a fresh seed each call: its launches never repeat)."""
    if config.graphs and not any(layer.p > 0.0 for layer in layers):
        start_recording(stream)


class _Chain(list):
    """A chain pass's launch sites (a list of :class:`_Slot`) and the CUDA graphs its recorded
    launches replay as (``replays``, see :func:`trainfuse._runtime.launch.finish_recording`)."""

    __slots__ = ("replays",)

    def __init__(self, sites: int) -> None:
        super().__init__(_Slot() for _ in range(sites))
        self.replays = Replays()


_chains: dict[tuple, _Chain] = {}


def _chain_slots(key: tuple, sites: int) -> _Chain:
    slots = _chains.get(key)
    if slots is None:
        if len(_chains) >= _MAX_PLANS:
            _chains.clear()
        slots = _chains[key] = _Chain(sites)
    return slots


def matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cd: torch.dtype, epi: int, *,
           act: int = 0, bias: torch.Tensor | None = None, bias_rows: bool = False,
           aux: torch.Tensor | None = None, pre: torch.Tensor | None = None, db: torch.Tensor | None = None,
           seed: int = 0, p: float = 0.0, drop_index: tuple[int, int] | None = None,
           accumulate: bool = False, stream: int | None = None, slot: _Slot | None = None) -> None:
    """``c = epilogue(a @ b)`` for 2-d views ``a`` (M, K), ``b`` (K, N), ``c``, ``aux``, ``pre``
    (M, N) with any strides. See :func:`_mm_kernel` for the epilogues; ``drop_index`` is
    ``(d_m, d_n)``, by default ``(N, 1)``; ``accumulate`` (``EPI_WGRAD``): add to what ``c`` and
    ``db`` hold; ``stream`` a raw CUDA stream (default: the current).

    The launch plan is cached on the call's signature, and the compiled kernel is launched
    directly: a training step repeats the same calls, and the host time per launch is what a
    small MLP's step is made of. A ``slot`` (a launch site of :class:`FusedMLPFunction`, whose
    chain signature already fixes this call's) skips even the keying once bound; its caller
    passes ``stream`` and has set Triton's allocator (:func:`trainfuse._runtime.launch.ensure_allocator`)."""
    x = aux if aux is not None else pre if pre is not None else c
    if pre is not None and act not in _DERIV_SAVED:
        raise ValueError("matmul: pre (the activation's derivative) is stored for GELU and SiLU only")
    has_bias = bias is not None or db is not None
    bias_t = bias if bias is not None else db if db is not None else c
    if slot is not None and slot.run is not None:
        slot.launch(stream, a, b, c, bias_t, x, seed, p)
        return
    if recording.launches is not None:
        interrupt_recording()
    drop = p > 0.0
    if accumulate and epi != EPI_WGRAD:
        raise ValueError("matmul: accumulate is for the weight grad epilogue only")
    key = (config.serial, epi, act, cd, bias_rows, drop, drop_index, pre is None, accumulate, a.device,
           a.shape, b.shape, a.stride(), b.stride(), c.stride(), x.stride(),
           a.dtype, b.dtype, c.dtype, x.dtype, has_bias and bias_t.dtype,
           a.data_ptr() % 16, b.data_ptr() % 16, c.data_ptr() % 16, x.data_ptr() % 16,
           bias_t.data_ptr() % 16, torch.backends.cuda.matmul.allow_tf32 if cd == torch.float32 else None)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:  # e.g. a new batch size every call: start over
            _plans.clear()
        plan = _plans[key] = _make_plan(a, b, c, x, cd, epi, act, has_bias, bias_rows, pre is not None,
                                        drop, drop_index, accumulate)
    if plan.constexprs["TMA"]:
        ensure_allocator()
    if plan.split > 1:  # split-K partials and per-tile arrival counters of this stream
        ws, cnt = stream_workspace(a.device, stream, torch.float32, plan.ws_floats, plan.tiles)
    else:
        ws = cnt = a
    launcher(_mm_kernel, plan.grid, a, b, c, bias_t, x, x, bias_t, ws, cnt, *plan.ints, seed, float(p),
             _drop_scale(p), num_warps=plan.warps, key=key, stream=stream, **plan.constexprs)
    if slot is not None:
        compiled = launcher.compiled(_mm_kernel, a.device.index, key)
        if compiled is not None:
            slot.bind(compiled, plan)


def _weight_first(w: torch.Tensor, cd: torch.dtype) -> bool:
    if config.weight_first is None:
        return cd != torch.float32
    return config.weight_first


def linear_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
                   pre: torch.Tensor | None, cd: torch.dtype, act: int, seed: int, p: float,
                   stream: int | None = None, slot: _Slot | None = None) -> None:
    """``out = dropout(f(x W^T + b))`` (and ``pre = f'(x W^T + b)``, GELU and SiLU only); with
    ``config.weight_first`` as ``out^T = W x^T``, so that the weight is the matmul's A operand."""
    first = _weight_first(w, cd)
    if slot is not None and slot.run is not None:
        slot.launch(stream, w if first else x, x if first else w, out, out if b is None else b,
                    out if pre is None else pre, seed, p)
    elif first:
        matmul(w, x.t(), out.t(), cd, EPI_FORWARD, act=act, bias=b, bias_rows=True,
               pre=None if pre is None else pre.t(), seed=seed, p=p, drop_index=(1, out.shape[1]),
               stream=stream, slot=slot)
    else:
        matmul(x, w.t(), out, cd, EPI_FORWARD, act=act, bias=b, pre=pre, seed=seed, p=p, stream=stream,
               slot=slot)


def linear_dgrad(dpre: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cd: torch.dtype, act: int,
                 saved: torch.Tensor | None, seed: int, p: float, stream: int | None = None,
                 slot: _Slot | None = None) -> None:
    """``out = (dpre W) * f'(saved) * keep / (1 - p)`` (the previous layer's activation and dropout
    grads; plain ``dpre W`` when there are none); ``config.weight_first`` as for the forward."""
    epi = EPI_ACT_GRAD if act or p > 0.0 else EPI_PLAIN
    first = _weight_first(w, cd)
    if slot is not None and slot.run is not None:
        slot.launch(stream, w if first else dpre, dpre if first else w, out, out,
                    out if saved is None else saved, seed, p)
    elif first:
        matmul(w.t(), dpre.t(), out.t(), cd, epi, act=act, aux=None if saved is None else saved.t(),
               seed=seed, p=p, drop_index=(1, out.shape[1]), stream=stream, slot=slot)
    else:
        matmul(dpre, w, out, cd, epi, act=act, aux=saved, seed=seed, p=p, stream=stream, slot=slot)


def act_grad(g: torch.Tensor, saved: torch.Tensor, out: torch.Tensor, act: int, seed: int, p: float,
             stream: int | None = None, slot: _Slot | None = None) -> None:
    """``out = g * f'(saved)`` (and the dropout mask), elementwise over row-major tensors. A
    ``slot`` (a chain's launch site, see :func:`matmul`) launches straight through the compiled
    kernel once bound: keying the launch took 45 us of host time on the H200 machines."""
    n = g.numel()
    if slot is not None and slot.run is not None:
        args = (g.data_ptr(), saved.data_ptr(), out.data_ptr(), n, seed, float(p), _drop_scale(p))
        rec = recording.launches
        if rec is not None:
            rec.append((slot.run, slot.grid, args))
        else:
            slot.run(slot.grid, stream, *args)
        return
    if recording.launches is not None:
        interrupt_recording()
    block = config.act_block
    grid = max(1, -(-n // block))
    rne = interpreting() and out.dtype == torch.bfloat16
    # what the compiled kernel depends on: Triton specializes n on == 1, % 16 and 32-bit (not seed)
    key = ("act_grad", config.serial, act, p > 0.0, rne, block, g.device, g.dtype, saved.dtype, out.dtype,
           g.data_ptr() % 16, saved.data_ptr() % 16, out.data_ptr() % 16, n == 1, n % 16 == 0, n < 2**31)
    launcher(_act_grad_kernel, (grid,), g, saved, out, n, seed, float(p), _drop_scale(p), ACT=act,
             DROP=p > 0.0, RNE=rne, BLOCK=block, num_warps=4, key=key, stream=stream)
    if slot is not None and g.device.type == "cuda":
        compiled = launcher.compiled(_act_grad_kernel, g.device.index, key)
        if compiled is not None:
            slot.bind_elementwise(compiled, grid)


def dropout_mask(seed: int, shape: tuple[int, int], p: float, device: torch.device | str) -> torch.Tensor:
    """The keep mask (bool, ``shape``) that a layer's dropout draws from ``seed``: what the
    forward applies (and the backward reads back or, with no activation, draws again). For tests
    and debugging."""
    n = math.prod(shape)
    out = torch.empty(shape, dtype=torch.int8, device=device)
    if n:
        _mask_kernel[(-(-n // 1024),)](out, n, seed, float(p), BLOCK=1024)
    return out.bool()


# ---- autograd -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)  # FusedMLP reuses one list of them across calls
class Layer:
    act: int  # ACTIVATIONS value
    p: float  # dropout probability (0: no dropout)
    # GELU/SiLU: the forward saves nothing for the activation; the backward runs the layer's
    # forward matmul again for f'(pre) (a rows x width buffer less held from forward to backward
    # per layer, for one more matmul)
    recompute: bool = False


_side_streams: dict[int, tuple[torch.cuda.Stream, list[torch.cuda.Event]]] = {}
# for the race test: cycles the side stream sleeps before each weight grad (torch.cuda._sleep)
_debug_side_sleep_cycles = 0


def _side_stream(device: torch.device, events: int) -> tuple[torch.cuda.Stream, list[torch.cuda.Event]]:
    """The device's side stream and at least ``events`` events to order it after the main one
    (made once: creating an event per wait costs host time in every backward)."""
    side = _side_streams.get(device.index)
    if side is None or len(side[1]) < events:
        stream = torch.cuda.Stream(device) if side is None else side[0]
        side = _side_streams[device.index] = (stream, [torch.cuda.Event() for _ in range(events)])
    return side


def _chain_key(x: torch.Tensor, weights, biases, layers: list[Layer], cd: torch.dtype, grads: bool) -> tuple:
    """What fixes every launch of a chain's forward (and, with the grad's layout, its backward):
    the input's and parameters' shapes, strides, dtypes and 16-byte alignment, the layers'
    activations and whether they drop, the compute dtype and the launch shapes. The tensors the
    chain makes itself (outputs, grads) are contiguous and aligned, so theirs follow from these."""
    key = [config.serial, cd, grads, x.device, x.shape, x.stride(), x.dtype, x.data_ptr() % 16,
           torch.backends.cuda.matmul.allow_tf32]
    for layer, w, b in zip(layers, weights, biases):
        key += (layer.act, layer.p > 0.0, layer.recompute, w.shape, w.stride(), w.dtype, w.data_ptr() % 16,
                None if b is None else (b.dtype, b.data_ptr() % 16))
    return tuple(key)


def _param_grads(weights, bias_dtypes, need_w, need_b, device) -> tuple[list, list]:
    """Empty weight grads (also where only the bias grad is wanted: the kernel writes both) and
    bias grads, carved from one allocation per dtype; a non-contiguous weight gets a grad of its
    own layout (autograd would copy a contiguous one)."""
    n = len(weights)
    gw, gb = [None] * n, [None] * n
    wanted: dict[torch.dtype, list[tuple[list, int, tuple]]] = {}
    for i, w in enumerate(weights):
        if not (need_w[i] or need_b[i]):
            continue
        if w.is_contiguous():
            wanted.setdefault(w.dtype, []).append((gw, i, tuple(w.shape)))
        else:
            gw[i] = torch.empty_like(w)
        if need_b[i]:
            wanted.setdefault(bias_dtypes[i], []).append((gb, i, (w.shape[0],)))
    for dtype, items in wanted.items():
        for (dest, i, _), t in zip(items, _carve([shape for *_, shape in items], dtype, device)):
            dest[i] = t
    return gw, gb


def _into_grad(node) -> torch.Tensor | None:
    """The leaf param behind ``node`` (an edge of the chain's backward node) if its grad may be
    written by the chain itself, as its AccumulateGrad node would: that node runs in this
    backward (not ``autograd.grad``, not left out of ``backward(inputs=...)``), and the param has
    no hooks that would see the grad on its way (tensor hooks, post-accumulate hooks)."""
    if type(node).__name__ != "AccumulateGrad":
        return None
    v = node.variable
    if v._backward_hooks or v._post_accumulate_grad_hooks:
        return None
    try:
        if torch._C._will_engine_execute_node(node) is not True:
            return None
    except RuntimeError:  # a leaf autograd.grad() captures
        return None
    return v


def _fusable(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the existing ``.grad`` ``g`` of ``p`` can be added to in the kernel: dense, laid
    out as the kernel writes a fresh one (row-major, 16-byte aligned), not part of a graph."""
    return (g.layout == torch.strided and not g.requires_grad and g.shape == p.shape
            and g.is_contiguous() and p.is_contiguous() and g.data_ptr() % 16 == 0)


def _direct_grads(ctx, n: int, need_w, need_b) -> list[tuple | None] | None:
    """Per layer, ``(weight, bias or None, accumulate)`` where the backward writes the layer's
    param grads into ``.grad`` itself instead of returning them to autograd (whose AccumulateGrad
    would then assign them, or add them to an existing grad in a kernel of its own), else None.

    Only where that is what autograd would do and nobody could tell: grad mode off (no
    ``create_graph``), no process group (DDP and FSDP reduce grads from hooks on the
    AccumulateGrad nodes that Python cannot see), not under torch.compile, both of the layer's
    params (:func:`_into_grad`), and their grads both None (assign) or both fusable (add)."""
    if ctx.create_graph or torch.compiler.is_compiling():
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    edges = ctx.next_functions  # the tensor inputs that need grads: x, the weights, the biases there are
    bias_edge = 1 + n
    direct: list[tuple | None] = [None] * n
    for i in range(n):
        has_bias = ctx.has_bias[i]
        if need_w[i] and (need_b[i] or not has_bias):
            w = _into_grad(edges[1 + i][0])
            b = _into_grad(edges[bias_edge][0]) if has_bias else None
            if w is not None and (b is not None or not has_bias):
                gw, gb = w.grad, None if b is None else b.grad
                if gw is None and gb is None:
                    direct[i] = (w, b, False)
                elif (gw is not None and _fusable(gw, w)
                      and (b is None or (gb is not None and _fusable(gb, b)))):
                    direct[i] = (w, b, True)
        bias_edge += has_bias
    return direct


class FusedMLPFunction(torch.autograd.Function):
    """The whole chain as one autograd node: ``apply(x, layers, cd, seed, streams, fuse_grads,
    *weights, *biases)`` with ``x`` 2-d; ``biases`` entries may be None. ``fuse_grads``: where
    autograd would, the backward writes the param grads into ``.grad`` itself, adding to existing
    ones in the weight-grad kernel (:func:`_direct_grads`)."""

    @staticmethod
    def forward(ctx, x, layers, cd, seed, streams, fuse_grads, *params):
        n = len(layers)
        weights, biases = params[:n], params[n:]
        grads = any(ctx.needs_input_grad)
        ctx.x_dtype = x.dtype
        if x.dtype != cd:  # rounded as the kernel would round it, once for both matmuls reading it
            x = x.to(cd)
        ctx.key = slots = stream = None
        if x.device.type == "cuda" and launcher.direct():
            ctx.key = _chain_key(x, weights, biases, layers, cd, grads)
            slots = _chain_slots(ctx.key, n)
            stream = torch._C._cuda_getCurrentRawStream(x.device.index)
            ensure_allocator()
        rows = x.shape[0]
        # the inner layers' outputs and the saved activation derivatives share one allocation; the
        # chain's output, which the caller keeps, has its own
        keep_pre = [grads and layer.act in _DERIV_SAVED and not layer.recompute for layer in layers]
        shapes = [(rows, w.shape[0]) for w in weights[:-1]]
        shapes += [(rows, w.shape[0]) for w, k in zip(weights, keep_pre) if k]
        carved = _carve(shapes, cd, x.device)
        outs = carved[:n - 1] + [torch.empty((rows, weights[-1].shape[0]), dtype=cd, device=x.device)]
        pres = iter(carved[n - 1:])
        h = x
        inputs, saved_act = [], []
        if slots is not None:
            _start_recording(stream, layers)
        try:
            for i, (layer, w, b) in enumerate(zip(layers, weights, biases)):
                out = outs[i]
                pre = next(pres) if keep_pre[i] else None
                linear_forward(h, w, b, out, pre, cd, layer.act, seed + i, layer.p, stream,
                               None if slots is None else slots[i])
                inputs.append(h)
                saved_act.append(pre if keep_pre[i] else out if layer.act == ACTIVATIONS["relu"] else None)
                h = out
        except BaseException:
            drop_recording()
            raise
        if slots is not None:
            finish_recording(slots.replays, x.device)
        ctx.layers, ctx.cd, ctx.seed, ctx.streams, ctx.fuse_grads = layers, cd, seed, streams, fuse_grads
        ctx.has_bias = [b is not None for b in biases]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        # recomputing a layer's forward takes its bias too
        ctx.recomputes = grads and any(layer.recompute and layer.act in _DERIV_SAVED for layer in layers)
        empty = inputs[0].new_empty(0)
        ctx.save_for_backward(*inputs, *[s if s is not None else empty for s in saved_act], *weights,
                              *([b if b is not None else empty for b in biases] if ctx.recomputes else []))
        return h

    @staticmethod
    def backward(ctx, grad):
        # once_differentiable runs the backward under no_grad: whether autograd builds a graph of
        # the grads (create_graph), which decides how it accumulates them, is seen out here
        ctx.create_graph = torch.is_grad_enabled()
        return FusedMLPFunction._backward(ctx, grad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, grad):
        layers, n = ctx.layers, len(ctx.layers)
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_w = need[6:6 + n]
        need_b = [need[6 + n + i] and ctx.has_bias[i] for i in range(n)]
        direct = (_direct_grads(ctx, n, need_w, need_b) if ctx.fuse_grads else None) or [None] * n
        accum = tuple(d and d[2] for d in direct)
        device = grad.device
        two = ctx.streams == 2 and device.type == "cuda"
        grad = grad.contiguous()
        slots = main_raw = None
        if ctx.key is not None and launcher.direct():
            # each layer's weight grad and input grad, and its recomputed forward if any
            # ... and the last activation's grad (the last site)
            slots = _chain_slots((ctx.key, grad.dtype, grad.data_ptr() % 16, need, two, accum),
                                 (3 * n if ctx.recomputes else 2 * n) + 1)
            main_raw = torch._C._cuda_getCurrentRawStream(device.index)
            ensure_allocator()
            if not two:  # two streams: the side stream's waits are not recorded
                _start_recording(main_raw, layers)
        try:
            dx, gw, gb, alive = FusedMLPFunction._launch_backward(ctx, grad, saved, direct, accum, slots,
                                                                  main_raw, two)
        except BaseException:
            drop_recording()
            raise
        if slots is not None and not two:
            finish_recording(slots.replays, device)
        del alive
        gb = [g if need_b[i] else None for i, g in enumerate(gb)]
        for i, d in enumerate(direct):
            if d is not None:
                if not d[2]:
                    d[0].grad = gw[i]
                    if d[1] is not None:
                        d[1].grad = gb[i]
                gw[i] = gb[i] = None
        return (dx, None, None, None, None, None, *gw, *gb)

    @staticmethod
    def _launch_backward(ctx, grad, saved, direct, accum, slots, main_raw, two):
        """The backward's launches (recorded, when :func:`_start_recording` turned it on): the last
        activation's grad, then per layer from the last its weight grad (on the side stream with
        ``two``) and input grad. Returns the input's grad (or None), the weight and bias grads and
        the scratch tensors the launches use (kept until recorded launches have been made)."""
        layers, cd, n = ctx.layers, ctx.cd, len(ctx.layers)
        inputs, acts, weights = saved[:n], saved[n:2 * n], saved[2 * n:3 * n]
        need = ctx.needs_input_grad
        need_x = need[0]
        need_w = need[6:6 + n]
        need_b = [need[6 + n + i] and ctx.has_bias[i] for i in range(n)]
        device = grad.device
        main = torch.cuda.current_stream(device) if two else None
        side, events = _side_stream(device, n + 1) if two else (None, None)
        side_raw = side.cuda_stream if two else None  # launched on directly: no stream switches
        keep = []  # tensors the side stream reads: alive until the main stream has joined it
        rows = grad.shape[0]
        biases = [b if ctx.has_bias[j] else None for j, b in enumerate(saved[3 * n:])]
        alive = []

        def saved_act(j: int) -> torch.Tensor | None:
            """What layer ``j``'s activation grad reads; a derivative the forward did not save is
            made now, just before its one use, by running the layer's forward matmul again (the
            same launch shape, so the same bits as if saved)."""
            layer = layers[j]
            if not layer.act:
                return None
            if layer.recompute and layer.act in _DERIV_SAVED:
                out_j, deriv = _carve([(rows, weights[j].shape[0])] * 2, cd, device)
                alive.append(out_j)
                linear_forward(inputs[j], weights[j], biases[j], out_j, deriv, cd, layer.act, ctx.seed + j,
                               layer.p, main_raw, None if slots is None else slots[2 * n + j])
                return deriv
            return acts[j]

        last = layers[-1]
        first_act = bool(last.act or last.p > 0.0)
        # the last activation's grad and the inner layers' input grads, in the order they are
        # written, from one allocation: each its own slice with two streams (the side stream reads
        # them until the join), two slices taking turns with one; the weight and bias grads of
        # each dtype share one allocation too (autograd takes such a view as the param's .grad as
        # it is, no copy: it is contiguous and the only reference)
        written = ([tuple(grad.shape)] if first_act else []) + [(rows, weights[i].shape[1])
                                                                for i in range(n - 1, 0, -1)]
        inner = (_carve if two else _alternating)(written, cd, device)
        alive.append(inner)
        # a grad added to in place is the kernel's output; the others are made here
        gw, gb = _param_grads(weights, ctx.bias_dtypes, [w and not a for w, a in zip(need_w, accum)],
                              [b and not a for b, a in zip(need_b, accum)], device)
        for i, d in enumerate(direct):
            if d is not None and d[2]:
                gw[i], gb[i] = d[0].grad, d[1].grad if d[1] is not None else None
        if first_act:
            dpre = inner[0]
            act_grad(grad, saved_act(n - 1) if last.act else grad, dpre, last.act, ctx.seed + n - 1, last.p,
                     main_raw, None if slots is None else slots[-1])
        else:
            dpre = grad
        dx = None
        for i in reversed(range(n)):
            w = weights[i]
            if need_w[i] or need_b[i]:
                if two:
                    events[i].record(main)
                    side.wait_event(events[i])
                    keep.append(dpre)
                    if _debug_side_sleep_cycles:
                        with torch.cuda.stream(side):
                            torch.cuda._sleep(_debug_side_sleep_cycles)
                slot = None if slots is None else slots[2 * i]
                stream = side_raw if two else main_raw
                if slot is not None and slot.run is not None:
                    db = gw[i] if gb[i] is None else gb[i]
                    slot.launch(stream, dpre, inputs[i], gw[i], db, gw[i], 0, 0.0)
                else:
                    matmul(dpre.t(), inputs[i], gw[i], cd, EPI_WGRAD, db=gb[i], accumulate=bool(accum[i]),
                           stream=stream, slot=slot)
            if i > 0:
                prev = layers[i - 1]
                out = inner[first_act + n - 1 - i]
                linear_dgrad(dpre, w, out, cd, prev.act, saved_act(i - 1), ctx.seed + i - 1,
                             prev.p, main_raw, None if slots is None else slots[2 * i + 1])
                dpre = out
            elif need_x:
                dx = torch.empty(inputs[0].shape, dtype=ctx.x_dtype, device=device)
                linear_dgrad(dpre, w, dx, cd, 0, None, 0, 0.0, main_raw, None if slots is None else slots[1])
        if two:
            events[n].record(side)
            main.wait_event(events[n])
            del keep
        return dx, gw, gb, alive


def mlp_reference(x: torch.Tensor, weights, biases, activations, dropout_masks=None, ps=None) -> torch.Tensor:
    """The chain in plain torch (``F.linear``, the activation, dropout with the given keep masks):
    what the kernels are tested against, in any dtype (float64 for the tight checks)."""
    fns = {"none": lambda v: v, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
           "silu": torch.nn.functional.silu}
    h = x
    for i, (w, b, act) in enumerate(zip(weights, biases, activations)):
        h = fns[act](torch.nn.functional.linear(h, w, b))
        if dropout_masks is not None and dropout_masks[i] is not None:
            h = h * dropout_masks[i].to(h.dtype) / (1.0 - ps[i])
    return h


__all__ = ["ACTIVATIONS", "FusedMLPFunction", "Layer", "MatmulConfig", "MatmulConfigs", "act_grad", "config",
           "dropout_mask", "linear_dgrad", "linear_forward", "matmul", "mlp_reference"]
