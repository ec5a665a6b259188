"""A 2x nearest upsampling concatenated with another map, as a YOLO neck computes it, in one
launch forward and one backward:

    upsample_concat(a, b) == torch.cat([F.interpolate(a, scale_factor=2, mode="nearest"), b], 1)

(``up_first=False``: ``b`` first; ``up_dtype``: the upsampling's dtype, as autocast makes it
float32, the concatenation then in float32 too as ``cat`` promotes). Every YOLO neck upsamples
twice and concatenates
each upsampled map with a backbone stage's. torch writes the upsampled map, then copies it and the
other into the concatenation; backward, its upsampling backward reads a strided slice of the
concatenation's grad. On an H200 at batch 16 and 640 px yolo11m's two upsamplings alone took about
0.6 ms of its step forward and backward (torch's channels_last nearest kernels run far below the
bytes they move). Here the forward writes the concatenation once from ``a`` and ``b``; the backward
sums each input pixel's four grads (float32, in torch's order: row by row, rounded once to the
dtype, as torch's kernels do) and hands ``b`` its slice of the grad as a view, as ``cat``'s
backward does. Values and grads are torch's bit for bit.
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
POSITIONS = 32  # output positions of a tile
CHANNELS = 64  # channels of a tile at most (128 bytes of a float16 channels_last position)


@triton.jit
def up_concat_fwd_kernel(a_ptr, b_ptr, out_ptr, CA, CB, H, W, P2, BA, BBLK, aN, aC, aH, aW, bN, bC, bH, bW,
                         oN, oC, oH, oW, A_AT, B_AT, BP: tl.constexpr, BC: tl.constexpr):
    """Program ``(i, j)`` (``j`` fastest): output positions ``[i * BP, (i + 1) * BP)`` of the
    ``P2 = N * 2H * 2W`` (image by image, row-major), channel block ``j``: blocks below ``BA`` copy
    ``a``'s pixel ``(h // 2, w // 2)`` into channels ``A_AT + ...``, the others ``b``'s pixel into
    ``B_AT + ...``."""
    pid = tl.program_id(0)
    blocks = BA + BBLK
    i = pid // blocks
    j = pid - i * blocks
    p = i * BP + tl.arange(0, BP)
    W2 = 2 * W
    HW2 = 2 * H * W2
    n = p // HW2
    r = p - n * HW2
    h2 = r // W2
    w2 = r - h2 * W2
    pm = p < P2
    out = out_ptr + n.to(tl.int64)[:, None] * oN + h2[:, None] * oH + w2[:, None] * oW
    if j < BA:
        c = j * BC + tl.arange(0, BC)
        m = pm[:, None] & (c < CA)[None, :]
        src_a = a_ptr + n.to(tl.int64)[:, None] * aN + c[None, :] * aC + (h2 // 2)[:, None] * aH \
            + (w2 // 2)[:, None] * aW  # a name of its own: a and b may differ in dtype
        tl.store(out + (A_AT + c)[None, :] * oC, tl.load(src_a, mask=m), mask=m)
    else:
        c = (j - BA) * BC + tl.arange(0, BC)
        m = pm[:, None] & (c < CB)[None, :]
        src_b = b_ptr + n.to(tl.int64)[:, None] * bN + c[None, :] * bC + h2[:, None] * bH + w2[:, None] * bW
        tl.store(out + (B_AT + c)[None, :] * oC, tl.load(src_b, mask=m), mask=m)


@triton.jit
def up_concat_bwd_kernel(g_ptr, da_ptr, CA, H, W, P, gN, gC, gH, gW, dN, dC, dH, dW, A_AT, BP: tl.constexpr,
                         BC: tl.constexpr, RNE: tl.constexpr):
    """Program ``(i, j)``: ``a``'s positions ``[i * BP, (i + 1) * BP)`` of ``P = N * H * W``,
    channel block ``j``: the four grads of each pixel's 2 x 2 block, added in float32 row by row
    and rounded once."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(CA, BC)
    i = pid // blocks
    c = (pid - i * blocks) * BC + tl.arange(0, BC)
    p = i * BP + tl.arange(0, BP)
    HW = H * W
    n = p // HW
    r = p - n * HW
    h = r // W
    w = r - h * W
    m = (p < P)[:, None] & (c < CA)[None, :]
    g = g_ptr + n.to(tl.int64)[:, None] * gN + (A_AT + c)[None, :] * gC
    acc = tl.zeros([BP, BC], tl.float32)
    for dy in tl.static_range(2):
        for dx in tl.static_range(2):
            at = (2 * h + dy)[:, None] * gH + (2 * w + dx)[:, None] * gW
            acc += tl.load(g + at, mask=m, other=0.0).to(tl.float32)
    if RNE:
        acc = round_bf16_rne(acc)
    da = da_ptr + n.to(tl.int64)[:, None] * dN + c[None, :] * dC + h[:, None] * dH + w[:, None] * dW
    tl.store(da, acc.to(da_ptr.dtype.element_ty), mask=m)


def _channels(C: int) -> int:
    return min(CHANNELS, max(4, next_power_of_2(C)))


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _nhwc(t: torch.Tensor) -> bool:
    """Whether torch suggests channels_last for ``t`` (a tensor both contiguous and channels_last,
    one channel or a 1 x 1 map, counts as contiguous)."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _layout(a: torch.Tensor, b: torch.Tensor) -> torch.memory_format:
    """The concatenation's memory format as torch makes it: the upsampling keeps ``a``'s suggested
    format, and ``cat`` keeps one its inputs share, else contiguous."""
    return torch.channels_last if _nhwc(a) and _nhwc(b) else torch.contiguous_format


class _UpsampleConcat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, up_first, dtype):
        N, CA, H, W = a.shape
        CB = b.shape[1]
        fmt = _layout(a, b)
        out = torch.empty(N, CA + CB, 2 * H, 2 * W, device=a.device, dtype=dtype, memory_format=fmt)
        a_at, b_at = (0, CA) if up_first else (CB, 0)
        P2 = N * 4 * H * W
        bc = _channels(max(CA, CB))
        ba, bb = cdiv(CA, bc), cdiv(CB, bc)
        launcher(up_concat_fwd_kernel, (cdiv(P2, POSITIONS) * (ba + bb),), a, b, out, CA, CB, H, W, P2, ba,
                 bb, *a.stride(), *b.stride(), *out.stride(), a_at, b_at, BP=POSITIONS, BC=bc, num_warps=4)
        ctx.a_at, ctx.b_at, ctx.shapes = a_at, b_at, (a.shape, CB)
        ctx.a_strides = a.stride()  # dense (checked): a fresh tensor may take them
        return out

    @staticmethod
    def backward(ctx, g):
        (N, CA, H, W), CB = ctx.shapes
        da = None
        if ctx.needs_input_grad[0]:
            da = torch.empty_strided((N, CA, H, W), ctx.a_strides, device=g.device, dtype=g.dtype)
            bc = _channels(CA)
            P = N * H * W
            launcher(up_concat_bwd_kernel, (cdiv(P, POSITIONS) * cdiv(CA, bc),), g, da, CA, H, W, P,
                     *g.stride(), *da.stride(), ctx.a_at, BP=POSITIONS, BC=bc,
                     RNE=interpreting() and g.dtype == torch.bfloat16, num_warps=4)
        # (in the output's dtype: autograd casts it to b's, as it does after cat's backward)
        db = g.narrow(1, ctx.b_at, CB) if ctx.needs_input_grad[1] else None
        return da, db, None, None


_apply = applier(_UpsampleConcat)


def upsample_concat_torch(a: torch.Tensor, b: torch.Tensor, up_first: bool = True,
                          up_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`upsample_concat` as torch runs it (the upsampling in ``up_dtype``, autocast off, then
    ``cat``): the reference of the tests and the path of CPUs."""
    with torch.autocast(a.device.type, enabled=False):
        up = F.interpolate(a if up_dtype is None else a.to(up_dtype), scale_factor=2.0, mode="nearest")
    return torch.cat([up, b] if up_first else [b, up], 1)


def upsample_concat(a: torch.Tensor, b: torch.Tensor, up_first: bool = True,
                    up_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cat([F.interpolate(a.to(up_dtype), scale_factor=2, mode="nearest"), b], 1)`` (``b``
    first where ``up_first`` is False; the module docstring): the same values and grads.

    Args:
        a: ``(N, Ca, H, W)`` float16, bfloat16 or float32, contiguous or channels_last.
        b: ``(N, Cb, 2H, 2W)`` on ``a``'s device.
        up_first: the upsampled map's channels first.
        up_dtype: the upsampling's dtype (None: ``a``'s; float32: as autocast runs it).

    Returns:
        ``(N, Ca + Cb, 2H, 2W)`` in the dtype ``cat`` gives (``up_dtype`` and ``b``'s promoted) and
        the memory format it gives. The kernels run where that dtype is ``up_dtype`` (``b``'s no
        wider) and ``up_dtype`` is ``a``'s or float32, both maps dense; torch's path otherwise.
    """
    if a.dim() != 4 or b.dim() != 4:
        raise ValueError(f"upsample_concat: a and b must be (N, C, H, W); got shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    N, _, H, W = a.shape
    if b.shape[0] != N or tuple(b.shape[2:]) != (2 * H, 2 * W):
        raise ValueError(f"upsample_concat: b must be ({N}, C, {2 * H}, {2 * W}) (a's batch, twice its "
                         f"size); got {tuple(b.shape)}")
    floats = (torch.float16, torch.bfloat16, torch.float32)
    dtype = a.dtype if up_dtype is None else up_dtype
    if (a.dtype not in floats or b.dtype not in floats or dtype not in (a.dtype, torch.float32)
            or torch.promote_types(dtype, b.dtype) != dtype or b.device != a.device or a.numel() == 0
            or b.numel() == 0 or not (_dense(a) and _dense(b)) or not use_triton(a.device)):
        return upsample_concat_torch(a, b, up_first, up_dtype)
    return _apply(a, b, bool(up_first), dtype)


__all__ = ["up_concat_bwd_kernel", "up_concat_fwd_kernel", "upsample_concat", "upsample_concat_torch"]
