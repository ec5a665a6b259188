"""FusedMLP's kernels: one matmul for a layer's forward, input grad and weight grad (:func:`mm_kernel`,
its ``EPI`` constexpr picking the epilogue), the last layer's elementwise activation grad, and the
dropout mask drawn alone (for tests and debugging).

The matmul's operands are addressed by strides, so ``W^T`` and ``dpre^T`` are read in place
(through TMA tensor descriptors, or pointers where the launch shape says so or the layout does not
allow TMA). Weights are read as they are stored (a float32 weight under bf16 autocast) and
converted to the compute dtype in registers, so no weight-cast kernel runs; accumulation is
float32. The bias grad is a second MMA of the ``dpre^T`` tiles with ones: deterministic, and on
the tensor cores (see :func:`_mma`).
"""

import triton
import triton.language as tl

from trainfuse._runtime.reduce import last_to_arrive
from trainfuse._runtime.rounding import round_bf16_rne
from trainfuse.nn.mlp.activations import activation, activation_and_deriv, keep_mask, undo_activation

# epilogues of mm_kernel
EPI_FORWARD = 0  # + bias, activation, dropout; optionally store the activation's derivative
EPI_ACT_GRAD = 1  # times the activation grad of the saved tensor, and the dropout mask
EPI_PLAIN = 2  # store as is (dgrad of the first layer, or of a layer with nothing to undo)
EPI_WGRAD = 3  # weight grad (+ bias grad: row sums of A), split over K when K is long; ACCUM adds to C

# the same numbers as constexprs, for the kernels (a jit function reads no other globals)
_EPI_FORWARD = tl.constexpr(EPI_FORWARD)
_EPI_ACT_GRAD = tl.constexpr(EPI_ACT_GRAD)
_EPI_WGRAD = tl.constexpr(EPI_WGRAD)
ROWSUM_N = tl.constexpr(16)  # columns of the bias grad's MMA (the narrowest tensor-core tile: n = 8 or 16)


@triton.jit
def to_dtype(v, dtype: tl.constexpr, RNE: tl.constexpr):
    """``v.to(dtype)``. With ``RNE`` (set under the interpreter, whose float32 -> bfloat16
    conversion rounds toward zero up to triton 3.9) a bfloat16 result is first rounded to nearest
    even in float32, as the GPU rounds, so that the interpreter tests check the GPU's numerics."""
    if RNE:
        if dtype == tl.bfloat16:
            v = round_bf16_rne(v.to(tl.float32))
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
        a32 = to_dtype(a, CD, True).to(tl.float32)
        acc = tl.dot(a32, to_dtype(b, CD, True).to(tl.float32), acc, input_precision="ieee")
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
    store scalar (one 2-byte st.global per element); ``RNE``: see :func:`to_dtype`."""
    if FULL:
        tl.store(ptr, to_dtype(v, ptr.dtype.element_ty, RNE))
    else:
        tl.store(ptr, to_dtype(v, ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _tile_load(ptr, mask, FULL: tl.constexpr):
    if FULL:
        return tl.load(ptr).to(tl.float32)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


# sizes and the seed vary call to call: not specialized on (a kernel per divisibility class of
# each would multiply the compiles); strides stay specialized (== 1 and 16-byte alignment matter)
@triton.jit(do_not_specialize=["M", "N", "K", "k_split", "nsplit", "d_m", "d_n", "seed"])
def mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, aux_ptr, pre_ptr, db_ptr, ws_ptr, cnt_ptr,
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
            if last_to_arrive(cnt_ptr + tile, nsplit):
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
                        tl.store(db_ptr + rm, to_dtype(rowsum, db_ptr.dtype.element_ty, UPCAST), mask=in_m)
                tl.store(cnt_ptr + tile, 0)  # re-armed for the next launch on this stream
        else:
            _tile_store(c_ptr + c_off, acc, mask, FULL, UPCAST)
            if ROWSUM:
                if pid_n == 0:
                    if ACCUM:
                        rowsum += tl.load(db_ptr + rm, mask=in_m, other=0.0).to(tl.float32)
                    tl.store(db_ptr + rm, to_dtype(rowsum, db_ptr.dtype.element_ty, UPCAST), mask=in_m)
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
                keep = keep_mask(seed, rm[:, None] * d_m + rn[None, :] * d_n, p)
            if STORE_PRE:  # f' for the backward, beside f (and times the mask: see undo_activation)
                v, deriv = activation_and_deriv(v, ACT)
                if DROP:
                    deriv = tl.where(keep, deriv * scale, 0.0)
                _tile_store(pre_ptr + x_off, deriv, mask, FULL, UPCAST)
            else:
                v = activation(v, ACT)
            if DROP:
                v = tl.where(keep, v * scale, 0.0)
        elif EPI == _EPI_ACT_GRAD:
            if ACT != 0:
                v = undo_activation(v, _tile_load(aux_ptr + x_off, mask, FULL), scale, ACT, DROP)
            elif DROP:
                keep = keep_mask(seed, rm[:, None] * d_m + rn[None, :] * d_n, p)
                v = tl.where(keep, v * scale, 0.0)
        _tile_store(c_ptr + c_off, v, mask, FULL, UPCAST)


@triton.jit(do_not_specialize=["seed"])
def act_grad_kernel(g_ptr, aux_ptr, out_ptr, n, seed, p, scale, ACT: tl.constexpr,
                     DROP: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr):
    """The last layer's activation (and dropout) grad, elementwise: its upstream grad comes from
    outside the chain, so no matmul of ours can take it in an epilogue."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT != 0:
        v = undo_activation(v, tl.load(aux_ptr + offs, mask=mask, other=0.0).to(tl.float32), scale, ACT, DROP)
    elif DROP:
        v = tl.where(keep_mask(seed, offs.to(tl.int32), p), v * scale, 0.0)
    tl.store(out_ptr + offs, to_dtype(v, out_ptr.dtype.element_ty, RNE), mask=mask)


@triton.jit
def mask_kernel(out_ptr, n, seed, p, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, keep_mask(seed, offs, p).to(tl.int8), mask=offs < n)


__all__ = ["EPI_ACT_GRAD", "EPI_FORWARD", "EPI_PLAIN", "EPI_WGRAD", "act_grad_kernel", "mask_kernel",
           "mm_kernel", "to_dtype"]
