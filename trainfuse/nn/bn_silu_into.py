"""BatchNorm2d then SiLU, a residual added where there is one, written straight into a channel
slice of a concatenation's buffer (:class:`~trainfuse.nn.concat.ConcatBuffer`): the last op of a
block whose output a ``torch.cat`` would otherwise copy (an ultralytics C2f's ``cv1`` and
bottlenecks, a C3's branches).

Forward, for the ``C`` channels of a convolution's output ``x`` (the constants ``s`` and ``t``
from :func:`~trainfuse.nn.bn_stats.statistics`, the math of :mod:`trainfuse.nn.bn_silu`)::

    y = silu(x s + t)                 (rounded to the buffer's dtype, as the module stores it)
    y = r + y                         (with a residual r: a bottleneck's shortcut)

stored in the buffer's slice (all ``C`` channels) and, for the channels from ``dense_from`` on,
also in a dense tensor of their own: what the next block's convolution reads (a slice of the
buffer is strided, and a convolution would copy it first). Backward, from the slice's grad (a
strided slice of the concatenation's grad) and the dense tensor's::

    g = dslice + ddense               (ddense on the channels from dense_from on)
    du = g silu'(u);  dw, db, dx as bn_silu;  dr = g

with the two grads added in float32 inside the kernels: the sum autograd would make of a tensor
read twice, a slice of it strided (half-speed adds in channels_last), is never written. Bytes per
element: forward 2 reads (3 with a residual) and 1 or 2 writes, against the eager module's BatchNorm,
SiLU, add and the concatenation's copy (6 to 9 reads and writes); backward as bn_silu, one more
read where the dense tensor has a grad and one more write for ``dr``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.function import applier
from trainfuse._runtime.launch import cdiv
from trainfuse.nn import bn_into_persist, bn_into_tiles, bn_persist, bn_silu, bn_stats, param_grads
from trainfuse.nn import channel_tiles as tiles
from trainfuse.nn.concat import ConcatBuffer


@triton.jit(do_not_specialize=["CB", "NSB"])
def into_apply_kernel(x_ptr, r_ptr, y_ptr, d_ptr, scale_ptr, shift_ptr, C, CB, S, NSB, sN, sC, sS, rN, rC, rS,
                      yN, yC, yS, dN, dC, dS, DF, BR: tl.constexpr, BC: tl.constexpr, EVEN_S: tl.constexpr,
                      MASKED: tl.constexpr, RESIDUAL: tl.constexpr, DENSE: tl.constexpr, REL32: tl.constexpr):
    """Tile ``q`` of channel block ``j`` (program ``q * CB + j``): ``y`` into the slice at
    ``y_ptr`` and, channels from ``DF`` on, into the dense tensor at ``d_ptr`` as its channels from
    0 (``DENSE``: 0 none, 1 every channel, 2 from ``DF`` on)."""
    q, j, c = tiles.program(CB, BC)
    cm = c < C
    s = tl.load(scale_ptr + c, mask=cm, other=0.0)
    t = tl.load(shift_ptr + c, mask=cm, other=0.0)
    bn_into_tiles.apply_tile(x_ptr, r_ptr, y_ptr, d_ptr, s, t, q, c, cm, S, NSB, sN, sC, sS, rN, rC, rS, yN,
                             yC, yS, dN, dC, dS, DF, BR, EVEN_S, MASKED, RESIDUAL, DENSE, REL32)


@triton.jit(do_not_specialize=["CB", "NSB", "Q", "tiles_per_program", "P"])
def into_grad_sums_kernel(x_ptr, g_ptr, e_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, sdu_ptr, sdux_ptr,
                          cnt_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, C, CB, S, NSB, Q, sN, sC, sS, gN, gC, gS,
                          eN, eC, eS, DF, tiles_per_program, P, BP: tl.constexpr, BR: tl.constexpr,
                          BC: tl.constexpr, UNROLL: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr,
                          ADD: tl.constexpr, REL32: tl.constexpr, GRAD: tl.constexpr):
    """Program ``(i, j)`` (``i * CB + j``): its tiles' sums of ``du`` and ``du xhat`` per channel,
    added up in a fixed order into ``dw`` and ``db`` by the last of channel block ``j``'s ``P``
    programs to arrive (as ``bn_silu_grad_sums_kernel``)."""
    i, j, c = tiles.program(CB, BC)
    bn_into_tiles.sums_program(x_ptr, g_ptr, e_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, sdu_ptr,
                               sdux_ptr, cnt_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, i, j, c, C, S, NSB, Q,
                               sN, sC, sS, gN, gC, gS, eN, eC, eS, DF, tiles_per_program, P, BP, BR, BC,
                               UNROLL, EVEN_S, MASKED, ADD, REL32, GRAD)


@triton.jit(do_not_specialize=["M", "CB", "NSB"])
def into_dx_kernel(x_ptr, g_ptr, e_ptr, dx_ptr, dr_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, dw_ptr,
                   db_ptr, M, C, CB, S, NSB, sN, sC, sS, gN, gC, gS, eN, eC, eS, DF, dN, dC, dS, fN, fC, fS,
                   TRAINING: tl.constexpr, DX: tl.constexpr, DR: tl.constexpr, BR: tl.constexpr,
                   BC: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, ADD: tl.constexpr,
                   REL32: tl.constexpr):
    """``dx = s (du - db / M - xhat dw / M)`` (training) or ``s du`` (``DX``), and the residual's
    grad ``dr = g`` (``DR``), over tile ``q`` of channel block ``j`` (program ``q * CB + j``)."""
    q, j, c = tiles.program(CB, BC)
    cm = c < C
    rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
    x, g, m = bn_into_tiles.grads_tile(x_ptr, g_ptr, e_ptr, q, c, cm, rel,
                                       tiles.tile_offsets(c, gC, gS, BR, REL32),
                                       tiles.tile_offsets(c - DF, eC, eS, BR, REL32), S, NSB, sN, sS, gN, gS,
                                       eN, eS, DF, BR, EVEN_S, MASKED, ADD)
    if DR:
        fbase, _ = tiles.tile_start(q, NSB, fN, fS, BR)
        tiles.store_tile(dr_ptr + fbase + tiles.tile_offsets(c, fC, fS, BR, REL32), g, m, MASKED)
    if DX:  # (bn_into_tiles.dx_tile's math, the constants read after the tile: fewer registers)
        s = tl.load(scale_ptr + c, mask=cm, other=0.0)
        t = tl.load(shift_ptr + c, mask=cm, other=0.0)
        du = bn_stats.silu_du(x, g, s, t)
        if TRAINING:
            mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
            invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
            dw = tl.load(dw_ptr + c, mask=cm, other=0.0)
            db = tl.load(db_ptr + c, mask=cm, other=0.0)
            xhat = (x - mean[None, :]) * invstd[None, :]
            du = du - db[None, :] / M - xhat * (dw[None, :] / M)
        dbase, _ = tiles.tile_start(q, NSB, dN, dS, BR)
        dx = du * s[None, :]
        tiles.store_tile(dx_ptr + dbase + tiles.tile_offsets(c, dC, dS, BR, REL32), dx, m, MASKED)


def _like(x: torch.Tensor, channels: int) -> torch.Tensor:
    """A new ``(N, channels, H, W)`` tensor in 4-d ``x``'s dtype and memory format."""
    N, _, H, W = x.shape
    fmt = torch.channels_last if x.stride(1) == 1 and x.shape[1] > 1 else torch.contiguous_format
    return torch.empty((N, channels, H, W), device=x.device, dtype=x.dtype, memory_format=fmt)


def _part(dense: bool, dense_from: int) -> int:
    """The kernels' ``DENSE`` / ``ADD``: 0 no dense tensor, 1 all channels, 2 from ``dense_from``."""
    return 0 if not dense else 1 if dense_from == 0 else 2


class _BatchNormSiLUInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, training, momentum, eps, piece,
                dense_from, tracked=None):
        # piece: the buffer's Slice, not a tensor: the slice it holds is returned as an output of
        # this Function, whose grad is the concatenation's slice
        launch, flags = bn_stats.launcher, bn_stats.flags
        out = piece.view()
        N, C, H, W = x.shape
        S = H * W
        if out.stride(2) != W * out.stride(3):  # (a ConcatBuffer's slices always merge)
            raise ValueError("batch_norm_silu_into: the slice's spatial dimensions must merge (a channel "
                             "slice of a contiguous or channels_last buffer)")
        of = out.view(N, C, S)
        xf = bn_stats.flat(x)
        dense = _like(x, C - dense_from) if dense_from < C else None
        rf = bn_stats.flat(residual) if residual is not None else xf
        df = bn_stats.flat(dense) if dense is not None else xf
        writes = (rf, of, df, dense_from, residual is not None, _part(dense is not None, dense_from))
        consts = None
        if training and bn_persist.enabled():  # the statistics and the writes in one launch, where it fits
            consts = bn_into_persist.forward(xf, writes, weight, bias, running_mean, running_var, momentum,
                                             eps, tracked)
        if consts is None:
            consts = bn_stats.statistics(xf, weight, bias, running_mean, running_var, training, momentum, eps,
                                         tracked)
            scale, shift = consts[0], consts[1]
            cfg = bn_stats.config(xf.stride(), C)
            cb, nsb = cdiv(C, cfg.channels), cdiv(S, cfg.rows)
            launch(into_apply_kernel, (N * nsb * cb,), xf, rf, of, df, scale, shift, C, cb, S, nsb,
                   *xf.stride(), *rf.stride(), *of.stride(), *df.stride(), dense_from, BR=cfg.rows,
                   BC=cfg.channels, RESIDUAL=residual is not None, DENSE=_part(dense is not None, dense_from),
                   num_warps=cfg.num_warps,
                   **flags(cfg, C, S, xf.stride(), rf.stride(), of.stride(), df.stride()))
        ctx.save_for_backward(xf, weight, consts)
        ctx.training, ctx.shape, ctx.dense_from = training, x.shape, dense_from
        ctx.residual = residual is not None
        ctx.set_materialize_grads(False)
        return out, dense

    @staticmethod
    def backward(ctx, dout, ddense):
        launch, flags = bn_stats.launcher, bn_stats.flags
        xf, weight, consts = ctx.saved_tensors
        direct, gw, gb = (param_grads.affine(ctx, 1, torch.is_grad_enabled())
                          if weight is not None and ctx.needs_input_grad[1] and ctx.needs_input_grad[2]
                          else (param_grads.NONE, None, None))
        scale, shift, mean, invstd = consts.unbind(0)
        N, C, S = xf.shape
        x = xf.view(ctx.shape)
        if dout is None:  # the concatenation's output went unused: only the dense tensor's grad
            dout = torch.zeros_like(x)
        gf = dout.reshape(N, C, S)  # a view for a slice of a contiguous or channels_last grad
        ef = bn_stats.flat(ddense) if ddense is not None else gf
        df = ctx.dense_from
        add = _part(ddense is not None, df)
        sums = torch.empty(2, C, device=xf.device, dtype=torch.float32)  # dw, db
        grads = (gw, gb) if direct else sums  # (unread without GRAD)
        need_dx, need_dr = ctx.needs_input_grad[0], ctx.residual and ctx.needs_input_grad[3]
        dx = _like(x, C) if need_dx else None
        dr = _like(x, C) if need_dr else None
        dxf = bn_stats.flat(dx) if need_dx else xf
        drf = bn_stats.flat(dr) if need_dr else xf
        # the sums and the grads in one launch where it fits (TRAINFUSE_BN_PERSIST=1)
        persisted = (ctx.training and (need_dx or need_dr) and bn_persist.enabled()
                     and bn_into_persist.backward(xf, gf, ef, df, add, dxf, drf, (need_dx, need_dr), consts,
                                                  sums, grads, direct))
        if persisted:
            param_grads.hand_over(ctx, 1, direct, gw, gb)
        elif ctx.training or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            rc = bn_stats.config(xf.stride(), C, reduce=True)
            rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
            P, per = bn_stats.split(N * rnsb, rcb, xf.device, rc)
            partials = torch.empty(2, P, C, device=xf.device, dtype=torch.float32)
            launch(into_grad_sums_kernel, (P * rcb,), xf, gf, ef, scale, shift, mean, invstd, *partials,
                   bn_stats.counters(xf.device, rcb), *sums, *grads, C, rcb, S, rnsb, N * rnsb, *xf.stride(),
                   *gf.stride(), *ef.stride(), df, per, P, BP=bn_stats.FINALIZE_ROWS, BR=rc.rows,
                   BC=rc.channels, UNROLL=rc.unroll, ADD=add, GRAD=direct, num_warps=rc.num_warps,
                   **flags(rc, C, S, xf.stride(), gf.stride(), ef.stride()))
            param_grads.hand_over(ctx, 1, direct, gw, gb)
        if (need_dx or need_dr) and not persisted:
            cfg = bn_stats.config(xf.stride(), C)
            cb, nsb = cdiv(C, cfg.channels), cdiv(S, cfg.rows)
            launch(into_dx_kernel, (N * nsb * cb,), xf, gf, ef, dxf, drf, scale, shift, mean, invstd, *sums,
                   N * S, C, cb, S, nsb, *xf.stride(), *gf.stride(), *ef.stride(), df, *dxf.stride(),
                   *drf.stride(), TRAINING=ctx.training, DX=need_dx, DR=need_dr, BR=cfg.rows, BC=cfg.channels,
                   ADD=add, num_warps=cfg.num_warps,
                   **flags(cfg, C, S, xf.stride(), gf.stride(), ef.stride(), dxf.stride(), drf.stride()))
        autograd = weight is not None and not direct  # else the kernel wrote them
        dw = sums[0].to(weight.dtype) if autograd and ctx.needs_input_grad[1] else None
        db = sums[1].to(weight.dtype) if autograd and ctx.needs_input_grad[2] else None
        return dx, dw, db, dr, None, None, None, None, None, None, None, None


_apply = applier(_BatchNormSiLUInto)

Tensor = torch.Tensor


def batch_norm_silu_into(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                         weight: Tensor | None, bias: Tensor | None, training: bool, momentum: float,
                         eps: float, buffer: ConcatBuffer, dense_from: int, residual: Tensor | None = None, *,
                         num_batches_tracked: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``y = silu(F.batch_norm(x, ...))`` (plus ``residual``) written into ``buffer``'s next slice
    (module docstring), the running statistics updated in place as ``F.batch_norm`` does.

    Args:
        x: a convolution's ``(N, C, H, W)`` output, float16, bfloat16 or float32 (float64 and
            devices without Triton take torch's ops and a copy), contiguous or channels_last.
        running_mean, running_var, weight, bias, training, momentum, eps: as
            :func:`~trainfuse.nn.bn_silu.batch_norm_silu`.
        buffer: the concatenation the ``C`` channels go into, at its next slice.
        dense_from: the channels from this one on are also returned as a dense tensor (``C``:
            none; ``0``: all).
        residual: a tensor shaped as ``x`` added to the SiLU's output (a bottleneck's shortcut).
        num_batches_tracked: as :func:`~trainfuse.nn.bn_silu.batch_norm_silu`'s.

    Returns:
        ``(slice, dense)``: the buffer's slice holding ``y``, for :meth:`ConcatBuffer.join`, and
        ``y[:, dense_from:]`` as a dense tensor in ``x``'s memory format (None for none).
    """
    fn = "batch_norm_silu_into"
    if x.dim() != 4:
        raise ValueError(f"{fn}: x must be (N, C, H, W); got shape {tuple(x.shape)}")
    C = x.shape[1]
    if not 0 <= dense_from <= C:
        raise ValueError(f"{fn}: dense_from must be in [0, {C}] (x's channels); got {dense_from}")
    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        raise ValueError(f"{fn}: residual must be shaped as x, {tuple(x.shape)} on {x.device}; got "
                         f"{tuple(residual.shape)} on {residual.device}")
    bn_silu.check(x, running_mean, running_var, weight, bias, training, fn, num_batches_tracked)
    fused = (x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel() > 0
             and use_triton(x.device) and (residual is None or residual.dtype == x.dtype))
    if not fused:
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        y = bn_silu.batch_norm_silu_torch(x, running_mean, running_var, weight, bias, training, momentum, eps)
        if residual is not None:
            y = residual + y
        return buffer.write(y), (y[:, dense_from:] if dense_from < C else None)
    return _apply(x, weight, bias, residual, running_mean, running_var, bool(training), float(momentum),
                  float(eps), buffer.slot(x, C), dense_from, num_batches_tracked)


__all__ = ["batch_norm_silu_into", "into_apply_kernel", "into_dx_kernel", "into_grad_sums_kernel"]
