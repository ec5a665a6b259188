"""A chain of max poolings concatenated with its input, as SPPF computes it, in one launch forward
and one backward:

    max_pool_chain(y, k, n) == torch.cat([y, m(y), m(m(y)), ...], 1)   # n poolings,
    m = nn.MaxPool2d(k, stride=1, padding=k // 2)

ultralytics' ``SPPF`` (every YOLOv5, v8, 11 and 26 backbone ends in one) pools its ``cv1`` output
three times with 5 x 5 windows and concatenates the four maps. torch runs that as three pooling
kernels, a concatenation, and backward three pooling backwards (each a gather of the outputs whose
argmax is the position) and two adds; on an H200 at batch 16 and 640 px the six pooling kernels
took about 0.5 ms of yolo11m's step on a 20 x 20 map, far from the bytes they move.

One program owns an image's whole map for a block of channels, so a level's neighbours are its
own: the forward copies ``y`` into the first slice of the output, then computes each level from
the one before (read back from the output, a barrier between levels) and keeps each window's
argmax as torch does (the first maximum in row-major order, a NaN always taken; a window of -inf
only keeps channels_last's index 0 or contiguous's window start, as torch's two kernels do). The
backward walks the levels down: level ``j``'s total grad is its slice's grad plus the pooling
backward of level ``j + 1``'s total, the latter summed in float32 over the window's outputs in
torch's order and rounded to the dtype before the add, as autograd adds the two grads of a map
that the concatenation and the next pooling both read. Values and grads are torch's bit for bit in
float16, bfloat16 and float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trainfuse._runtime.backend import interpreting, use_triton
from trainfuse._runtime.function import applier
from trainfuse._runtime.launch import CachedLauncher, cdiv, next_power_of_2
from trainfuse._runtime.rounding import round_bf16_rne

launcher = CachedLauncher()
POSITIONS = 128  # positions of a tile (a program walks its map in tiles of POSITIONS x channels)
# channels of a program at most (fewer where the map has fewer): 16 float16 channels are a 32-byte
# sector of a channels_last position, and 16 x 256 channels of yolo11m's SPPF at batch 16 make 256
# programs
CHANNELS = 16


@triton.jit
def _store(ptr, v, m, RNE: tl.constexpr):
    """``v`` (float32) stored in ``ptr``'s dtype; ``RNE``: bfloat16 rounded to nearest even by hand
    (the interpreter's conversion truncates)."""
    if RNE:
        v = round_bf16_rne(v)
    tl.store(ptr, v.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def pool_chain_fwd_kernel(y_ptr, out_ptr, arg_ptr, C, CB, H, W, yN, yC, yH, yW, oN, oC, oH, oW, aL, aN, aC,
                          aH, aW, K: tl.constexpr, LEVELS: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr,
                          NHWC: tl.constexpr):
    """Program ``n * CB + j``: image ``n``, channels ``[j * BC, (j + 1) * BC)``; ``y`` into slice 0
    of ``out``, then level ``l`` (slice ``l``) from level ``l - 1`` with its argmax (a position
    ``h * W + w`` of the map) in ``arg[l - 1]``. The window's positions are a loop, not unrolled:
    a program's map is in its SM's L1 after the first level, and 25 loads in flight a tile would
    spill."""
    pid = tl.program_id(0)
    n = pid // CB
    c = (pid % CB) * BC + tl.arange(0, BC)
    cm = c < C
    PAD: tl.constexpr = K // 2
    HW = H * W
    C64 = C + tl.zeros([], tl.int64)  # C may come as a Python int (Triton specializes a 1)
    y_img = y_ptr + n.to(tl.int64) * yN
    o_img = out_ptr + n.to(tl.int64) * oN
    for p0 in range(0, HW, BP):
        p = p0 + tl.arange(0, BP)
        h = p // W
        w = p - h * W
        m = (p < HW)[:, None] & cm[None, :]
        v = tl.load(y_img + c[None, :] * yC + h[:, None] * yH + w[:, None] * yW, mask=m)
        tl.store(o_img + c[None, :] * oC + h[:, None] * oH + w[:, None] * oW, v, mask=m)
    for level in tl.static_range(1, LEVELS + 1):
        tl.debug_barrier()  # the level before is in the output, whoever of the program wrote it
        src = o_img + (level - 1) * C64 * oC
        dst = o_img + level * C64 * oC
        arg = arg_ptr + (level - 1) * aL + n.to(tl.int64) * aN
        for p0 in range(0, HW, BP):
            p = p0 + tl.arange(0, BP)
            pm = p < HW
            h = p // W
            w = p - h * W
            best = tl.full([BP, BC], float("-inf"), tl.float32)
            if NHWC:  # torch's channels_last kernel starts every window at index 0
                where = tl.zeros([BP, BC], tl.int32)
            else:  # its contiguous kernel at the window's first position
                start = tl.maximum(h - PAD, 0) * W + tl.maximum(w - PAD, 0)
                where = start[:, None] + tl.zeros([BP, BC], tl.int32)
            for d in range(K * K):  # row-major, as torch scans the window
                ih = h - PAD + d // K
                iw = w - PAD + d % K
                inside = pm & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                v = tl.load(src + c[None, :] * oC + ih[:, None] * oH + iw[:, None] * oW,
                            mask=inside[:, None] & cm[None, :], other=float("-inf")).to(tl.float32)
                take = ((v > best) | (v != v)) & inside[:, None]
                best = tl.where(take, v, best)
                where = tl.where(take, (ih * W + iw)[:, None], where)
            m = pm[:, None] & cm[None, :]
            at = c[None, :] * oC + h[:, None] * oH + w[:, None] * oW
            tl.store(dst + at, best.to(out_ptr.dtype.element_ty), mask=m)
            tl.store(arg + c[None, :] * aC + h[:, None] * aH + w[:, None] * aW, where, mask=m)


@triton.jit
def pool_chain_bwd_kernel(g_ptr, arg_ptr, dx_ptr, tmp_ptr, C, CB, H, W, gN, gC, gH, gW, aL, aN, aC, aH, aW,
                          xN, xC, xH, xW, K: tl.constexpr, LEVELS: tl.constexpr, BP: tl.constexpr,
                          BC: tl.constexpr, RNE: tl.constexpr):
    """Program ``n * CB + j`` (as the forward's): from level ``LEVELS`` down, level ``l - 1``'s
    total grad = its slice of ``g`` + the pooling backward of level ``l``'s total; the totals
    alternate between ``tmp`` and ``dx`` (``dx``'s strides for both) so that level 0's lands in
    ``dx``."""
    pid = tl.program_id(0)
    n = pid // CB
    c = (pid % CB) * BC + tl.arange(0, BC)
    cm = c < C
    PAD: tl.constexpr = K // 2
    HW = H * W
    C64 = C + tl.zeros([], tl.int64)  # C may come as a Python int (Triton specializes a 1)
    g_img = g_ptr + n.to(tl.int64) * gN
    x_img = n.to(tl.int64) * xN
    for level in tl.static_range(LEVELS, 0, -1):
        tl.debug_barrier()  # level's total is complete
        if level == LEVELS:  # the last level's total is its slice's grad
            top = g_img + level * C64 * gC
            tC, tH, tW = gC, gH, gW
        elif level % 2 == 1:
            top = tmp_ptr + x_img
            tC, tH, tW = xC, xH, xW
        else:
            top = dx_ptr + x_img
            tC, tH, tW = xC, xH, xW
        if (level - 1) % 2 == 1:
            out = tmp_ptr + x_img
        else:
            out = dx_ptr + x_img
        arg = arg_ptr + (level - 1) * aL + n.to(tl.int64) * aN
        below = g_img + (level - 1) * C64 * gC
        for p0 in range(0, HW, BP):
            p = p0 + tl.arange(0, BP)
            pm = p < HW
            h = p // W
            w = p - h * W
            acc = tl.zeros([BP, BC], tl.float32)
            for d in range(K * K):  # the outputs whose window holds p, in torch's order
                oh = h - PAD + d // K
                ow = w - PAD + d % K
                inside = (pm & (oh >= 0) & (oh < H) & (ow >= 0) & (ow < W))[:, None] & cm[None, :]
                a = tl.load(arg + c[None, :] * aC + oh[:, None] * aH + ow[:, None] * aW, mask=inside,
                            other=-1)
                # loaded whole (vector loads), kept where the output's argmax is p: acc never holds
                # -0.0, so the +0.0 of the others changes no bit of torch's sum over the hits
                t = tl.load(top + c[None, :] * tC + oh[:, None] * tH + ow[:, None] * tW, mask=inside,
                            other=0.0)
                acc += tl.where(a == p[:, None], t.to(tl.float32), 0.0)
            m = pm[:, None] & cm[None, :]
            if RNE:
                acc = round_bf16_rne(acc)
            pooled = acc.to(dx_ptr.dtype.element_ty).to(tl.float32)  # the pooling's grad, in the dtype
            own = tl.load(below + c[None, :] * gC + h[:, None] * gH + w[:, None] * gW, mask=m, other=0.0)
            total = own.to(tl.float32) + pooled
            _store(out + c[None, :] * xC + h[:, None] * xH + w[:, None] * xW, total, m, RNE)


def _tile(C: int, HW: int) -> tuple[int, int]:
    """(positions, channels) of a tile: the channels cut to ``C``'s power of two (at least 4), the
    positions grown to keep the tile's size, and cut to the map's ``HW`` power of two (at least 16)."""
    channels = min(CHANNELS, max(4, next_power_of_2(C)))
    return min(POSITIONS * CHANNELS // channels, max(16, next_power_of_2(HW))), channels


def _nhwc(y: torch.Tensor) -> bool:
    """Whether torch pools ``y`` with its channels_last kernel (``suggest_memory_format``)."""
    return y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()


class _PoolChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, k, n):
        N, C, H, W = y.shape
        fmt = torch.channels_last if _nhwc(y) else torch.contiguous_format
        out = torch.empty(N, (n + 1) * C, H, W, device=y.device, dtype=y.dtype, memory_format=fmt)
        if fmt == torch.channels_last:  # each level's argmax in y's layout
            arg = torch.empty(n, N, H, W, C, device=y.device, dtype=torch.int32).permute(0, 1, 4, 2, 3)
        else:
            arg = torch.empty(n, N, C, H, W, device=y.device, dtype=torch.int32)
        bp, bc = _tile(C, H * W)
        cb = cdiv(C, bc)
        launcher(pool_chain_fwd_kernel, (N * cb,), y, out, arg, C, cb, H, W, *y.stride(), *out.stride(),
                 *arg.stride(), K=k, LEVELS=n, BP=bp, BC=bc, NHWC=fmt == torch.channels_last, num_warps=4)
        ctx.save_for_backward(arg)
        ctx.k, ctx.n, ctx.shape, ctx.fmt = k, n, y.shape, fmt
        return out

    @staticmethod
    def backward(ctx, g):
        (arg,) = ctx.saved_tensors
        N, C, H, W = ctx.shape
        dx = torch.empty(ctx.shape, device=g.device, dtype=g.dtype, memory_format=ctx.fmt)
        tmp = torch.empty_like(dx) if ctx.n > 1 else dx
        bp, bc = _tile(C, H * W)
        cb = cdiv(C, bc)
        rne = interpreting() and g.dtype == torch.bfloat16
        launcher(pool_chain_bwd_kernel, (N * cb,), g, arg, dx, tmp, C, cb, H, W, *g.stride(), *arg.stride(),
                 *dx.stride(), K=ctx.k, LEVELS=ctx.n, BP=bp, BC=bc, RNE=rne, num_warps=4)
        return dx, None, None


_apply = applier(_PoolChain)


def max_pool_chain_torch(y: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """:func:`max_pool_chain` as torch runs it (SPPF's forward): the reference of the tests and the
    path of CPUs."""
    maps = [y]
    for _ in range(n):
        maps.append(F.max_pool2d(maps[-1], k, 1, k // 2))
    return torch.cat(maps, 1)


def max_pool_chain(y: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """``torch.cat([y, m(y), m(m(y)), ...], 1)`` with ``n`` poolings ``m = nn.MaxPool2d(k, 1, k // 2)``
    (the module docstring): the same values and grads.

    Args:
        y: ``(N, C, H, W)`` float16, bfloat16 or float32 (float64 takes torch's path), contiguous or
            channels_last.
        k: the pooling window's side, odd (the padding ``k // 2`` keeps the map's size).
        n: poolings in the chain, at least 1.

    Returns:
        ``(N, (n + 1) C, H, W)`` in ``y``'s dtype and memory format.
    """
    if y.dim() != 4:
        raise ValueError(f"max_pool_chain: y must be (N, C, H, W); got shape {tuple(y.shape)}")
    if not isinstance(k, int) or k < 1 or k % 2 == 0 or k > 15:
        raise ValueError(f"max_pool_chain: k must be an odd int from 1 to 15 (the padding k // 2 keeps the "
                         f"size); got {k!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"max_pool_chain: n must be an int >= 1 (poolings in the chain); got {n!r}")
    if (y.dtype not in (torch.float16, torch.bfloat16, torch.float32) or y.numel() == 0
            or not use_triton(y.device) or not (_nhwc(y) or y.is_contiguous())):
        return max_pool_chain_torch(y, k, n)
    return _apply(y, k, n)


__all__ = ["max_pool_chain", "max_pool_chain_torch", "pool_chain_bwd_kernel", "pool_chain_fwd_kernel"]
