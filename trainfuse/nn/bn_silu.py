"""BatchNorm2d followed by SiLU, the tail of every ultralytics ``Conv`` block, in two launches
forward and two backward, keeping only the convolution's output for the backward.

For channel ``c`` over the ``M = N H W`` values ``x`` of a batch (training)::

    mean_c = sum x / M            var_c = sum (x - mean_c)^2 / M        r_c = 1 / sqrt(var_c + eps)
    u = (x - mean_c) r_c w_c + b_c = x s_c + t_c        (s_c = w_c r_c, t_c = b_c - mean_c s_c)
    y = silu(u) = u sigmoid(u)
    running_mean <- (1 - m) running_mean + m mean_c
    running_var <- (1 - m) running_var + m var_c M / (M - 1)

and backward, from ``dy``, with ``xhat = (x - mean_c) r_c`` and
``du = dy sigmoid(u) (1 + u (1 - sigmoid(u)))``::

    dw_c = sum du xhat        db_c = sum du        dx = s_c (du - db_c / M - xhat dw_c / M)

(outside training the running statistics take the batch's place and ``dx = s_c du``).

Forward: a program per (run of tiles, block of channels) folds its positions into a count, a mean
and a sum of squared deviations per channel (Chan's merge of chunk statistics, no ``E[x^2] -
E[x]^2`` cancellation); the last program of each channel block to arrive (an arrival counter per
block) merges the block's partials in a fixed order, updates the running statistics and writes ``s``
and ``t``; a second pass writes ``y``. Backward: partial sums of ``du`` and ``du xhat`` and, by the
last to arrive, their fixed-order total, then ``dx``, ``u`` recomputed from ``x`` both times. No
program adds into another's output, and the totals' order does not depend on which program arrives
last: the same inputs give the same bits in every run, eager or replayed from a CUDA graph. A tile's
addresses are one scalar per tile plus offsets made once per program
(:mod:`trainfuse.nn.channel_tiles`); masks only where a tile or a channel block runs past the
tensor, and where the positions fill whole tiles the reductions take their count from the host
instead of counting element by element: the same bits as the masked path (the tests compare the
two).

Bytes per activation element: forward 2 reads and a write, backward 4 reads and a write, against
torch's 3 reads and 2 writes (cuDNN's BatchNorm, then SiLU over its output) and 6 reads and 2
writes; and the BatchNorm's output is not kept for SiLU's backward. Math in float32, ``y`` and
``dx`` in ``x``'s dtype (float16, bfloat16, float32); statistics and parameter grads in float32,
the grads cast to the parameters' dtype. Contiguous and channels_last inputs are read in place.
Float64 inputs and devices without Triton take :func:`batch_norm_silu_torch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.function import applier
from trainfuse._runtime.launch import cdiv
from trainfuse.nn import bn_grad_sums, bn_persist, bn_stats, param_grads
from trainfuse.nn import channel_tiles as tiles


@triton.jit(do_not_specialize=["CB", "NSB"])
def bn_silu_apply_kernel(x_ptr, y_ptr, scale_ptr, shift_ptr, C, CB, S, NSB, sN, sC, sS, yN, yC, yS, SPLIT, yP,
                         BR: tl.constexpr, BC: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr,
                         PART: tl.constexpr, REL32: tl.constexpr):
    """``y = silu(x s + t)`` over tile ``q`` of channel block ``j`` (program ``q * CB + j``). Channels
    from ``SPLIT`` on go to a second part of ``y``, ``yP`` elements on, as its channels from 0
    (``PART`` 0: one part; 1: the split at a multiple of the block; 2: anywhere)."""
    q, j, c = tiles.program(CB, BC)
    cm = c < C
    base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
    m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
    x = tiles.load_tile(x_ptr + base + tiles.tile_offsets(c, sC, sS, BR, REL32), m, MASKED)
    s = tl.load(scale_ptr + c, mask=cm, other=0.0)
    t = tl.load(shift_ptr + c, mask=cm, other=0.0)
    u = x * s[None, :] + t[None, :]
    y = u * tl.sigmoid(u)
    out = tiles.tile_addresses(y_ptr, y_ptr + yP, q, j, c, NSB, yN, yC, yS, yN, yC, yS, SPLIT, BR, BC, PART,
                               REL32)
    tiles.store_tile(out, y, m, MASKED)


@triton.jit(do_not_specialize=["CB", "NSB", "Q", "tiles_per_program", "P"])
def bn_silu_grad_sums_kernel(x_ptr, dy_ptr, dy1_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, sdu_ptr,
                             sdux_ptr, cnt_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, C, CB, S, NSB, Q, sN, sC, sS,
                             gN, gC, gS, hN, hC, hS, SPLIT, tiles_per_program, P, BP: tl.constexpr,
                             BR: tl.constexpr, BC: tl.constexpr, UNROLL: tl.constexpr, EVEN_S: tl.constexpr,
                             MASKED: tl.constexpr, PART: tl.constexpr, REL32: tl.constexpr,
                             G_SAME: tl.constexpr, GRAD: tl.constexpr):
    """Program ``(i, j)`` (``i * CB + j``): its tiles' sums of ``du`` and ``du xhat`` per channel
    at ``[i, c]``; the last of channel block ``j``'s ``P`` programs to arrive adds them up in a
    fixed order into ``dw`` and ``db`` (and with ``GRAD`` into the params' grads ``gw``, ``gb``:
    :func:`~trainfuse.nn.bn_stats.grad_finalize`). ``dy``'s channels from ``SPLIT`` on are
    ``dy1``'s (C, and ``dy`` again, for one part); the tiles walked as the statistics walk them.
    ``G_SAME``: one part laid out as ``x``, read at ``x``'s offsets
    (:func:`~trainfuse.nn.bn_grad_sums.grad_sums_program`)."""
    i, j, c = tiles.program(CB, BC)
    bn_grad_sums.grad_sums_program(x_ptr, dy_ptr, dy1_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr,
                                   sdu_ptr, sdux_ptr, cnt_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, i, j, c, C, S,
                                   NSB, Q, sN, sC, sS, gN, gC, gS, hN, hC, hS, SPLIT, tiles_per_program, P,
                                   BP, BR, BC, UNROLL, EVEN_S, MASKED, PART, REL32, G_SAME, GRAD)


@triton.jit(do_not_specialize=["M", "CB", "NSB"])
def bn_silu_dx_kernel(x_ptr, dy_ptr, dy1_ptr, dx_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, dw_ptr,
                      db_ptr, M, C, CB, S, NSB, sN, sC, sS, gN, gC, gS, hN, hC, hS, SPLIT, dN, dC, dS,
                      TRAINING: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, EVEN_S: tl.constexpr,
                      MASKED: tl.constexpr, PART: tl.constexpr, REL32: tl.constexpr):
    """``dx = s (du - db / M - xhat dw / M)`` (training) or ``s du`` over tile ``q`` of channel
    block ``j`` (program ``q * CB + j``); ``dy`` in two parts as in the grad sums."""
    q, j, c = tiles.program(CB, BC)
    cm = c < C
    base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
    m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
    s = tl.load(scale_ptr + c, mask=cm, other=0.0)
    t = tl.load(shift_ptr + c, mask=cm, other=0.0)
    x = tiles.load_tile(x_ptr + base + tiles.tile_offsets(c, sC, sS, BR, REL32), m, MASKED)
    grads = tiles.tile_addresses(dy_ptr, dy1_ptr, q, j, c, NSB, gN, gC, gS, hN, hC, hS, SPLIT, BR, BC, PART,
                                 REL32)
    du = bn_stats.silu_du(x, tiles.load_tile(grads, m, MASKED), s, t)
    if TRAINING:
        mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
        invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
        dw = tl.load(dw_ptr + c, mask=cm, other=0.0)
        db = tl.load(db_ptr + c, mask=cm, other=0.0)
        xhat = (x - mean[None, :]) * invstd[None, :]
        du = du - db[None, :] / M - xhat * (dw[None, :] / M)
    dbase, _ = tiles.tile_start(q, NSB, dN, dS, BR)
    tiles.store_tile(dx_ptr + dbase + tiles.tile_offsets(c, dC, dS, BR, REL32), du * s[None, :], m, MASKED)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two dense ``(N, C / 2, H, W)`` tensors in ``x``'s memory format (channels_last or
    contiguous), views of one buffer, and the elements from the first's start to the second's."""
    N, C, H, W = x.shape
    half = C // 2
    buf = torch.empty(2 * N * half * H * W, device=x.device, dtype=x.dtype)
    if x.stride(1) == 1 and C > 1:  # channels_last
        strides = (H * W * half, 1, W * half, half)
    else:
        strides = (half * H * W, H * W, W, 1)
    part = N * half * H * W
    return (buf.as_strided((N, half, H, W), strides), buf.as_strided((N, half, H, W), strides, part), part)


class _BatchNormSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, split=False,
                tracked=None):
        launch, flags = bn_stats.launcher, bn_stats.flags
        shape = x.shape
        x = bn_stats.flat(x)
        N, C, S = x.shape
        cfg = bn_stats.config(x.stride(), C)
        cb = cdiv(C, cfg.channels)
        nsb = cdiv(S, cfg.rows)
        ctx.training, ctx.split, ctx.shape = training, split, shape
        if training and bn_persist.enabled():  # statistics and y in one launch, where it fits
            if split:
                y0, y1, part = _halves(x.view(shape))
                out, ys, at = y0, bn_stats.flat(y0).stride(), C // 2
            else:
                out = torch.empty_like(x)
                ys, at, part = out.stride(), C, 0
            consts = bn_persist.forward(x, out, ys, at, part, weight, bias, running_mean, running_var,
                                        momentum, eps, tracked)
            if consts is not None:
                ctx.save_for_backward(x, weight, consts)
                return (y0, y1) if split else out.view(shape)
        consts = bn_stats.statistics(x, weight, bias, running_mean, running_var, training, momentum, eps,
                                     tracked)
        scale, shift, mean, invstd = consts.unbind(0)
        ctx.save_for_backward(x, weight, consts)
        if split:  # two outputs, each dense: C2f's halves (split_batch_norm_silu)
            y0, y1, part = _halves(x.view(shape))
            ys = bn_stats.flat(y0).stride()
            launch(bn_silu_apply_kernel, (N * nsb * cb,), x, y0, scale, shift, C, cb, S, nsb, *x.stride(),
                   *ys, C // 2, part, BR=cfg.rows, BC=cfg.channels, num_warps=cfg.num_warps,
                   **flags(cfg, C, S, x.stride(), ys, split=C // 2))
            return y0, y1
        y = torch.empty_like(x)  # x's strides: channels_last stays channels_last
        launch(bn_silu_apply_kernel, (N * nsb * cb,), x, y, scale, shift, C, cb, S, nsb, *x.stride(),
               *y.stride(), C, 0, BR=cfg.rows, BC=cfg.channels, num_warps=cfg.num_warps,
               **flags(cfg, C, S, x.stride(), y.stride(), split=C))
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy, dy1=None):
        launch, flags = bn_stats.launcher, bn_stats.flags
        x, weight, consts = ctx.saved_tensors
        # the weight's and bias's grads written or added to by the kernel where nothing could tell
        # (trainfuse.nn.param_grads), else handed to autograd
        direct, gw, gb = (param_grads.affine(ctx, 1, torch.is_grad_enabled())
                          if weight is not None and ctx.needs_input_grad[1] and ctx.needs_input_grad[2]
                          else (param_grads.NONE, None, None))
        scale, shift, mean, invstd = consts.unbind(0)
        shape = ctx.shape
        N, C, S = x.shape
        # the halves' grads read where they are (an unused half's comes as zeros: the Function
        # materializes it); one part: the second is the first, from channel C on (none)
        dy = bn_stats.flat(dy)
        dy1, split = (bn_stats.flat(dy1), C // 2) if ctx.split else (dy, C)
        sums = torch.empty(2, C, device=x.device, dtype=torch.float32)  # dw, db
        grads = (gw, gb) if direct else sums  # (unread without GRAD)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        # the sums and dx in one launch where it fits (TRAINFUSE_BN_PERSIST=1)
        persisted = (dx is not None and ctx.training and bn_persist.enabled()
                     and bn_persist.backward(x, dy, dy1, split, dx, consts, sums, grads, direct))
        if not persisted:
            rc = bn_stats.config(x.stride(), C, reduce=True)
            rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
            P, per = bn_stats.split(N * rnsb, rcb, x.device, rc)
            partials = torch.empty(2, P, C, device=x.device, dtype=torch.float32)
            launch(bn_silu_grad_sums_kernel, (P * rcb,), x, dy, dy1, scale, shift, mean, invstd, *partials,
                   bn_stats.counters(x.device, rcb), *sums, *grads, C, rcb, S, rnsb, N * rnsb, *x.stride(),
                   *dy.stride(), *dy1.stride(), split, per, P, BP=bn_stats.FINALIZE_ROWS, BR=rc.rows,
                   BC=rc.channels, UNROLL=rc.unroll, num_warps=rc.num_warps,
                   G_SAME=split >= C and dy.stride() == x.stride(), GRAD=direct,
                   **flags(rc, C, S, x.stride(), dy.stride(), dy1.stride(), split=split))
        param_grads.hand_over(ctx, 1, direct, gw, gb)
        if dx is not None and not persisted:
            cfg = bn_stats.config(x.stride(), C)
            cb = cdiv(C, cfg.channels)
            nsb = cdiv(S, cfg.rows)
            launch(bn_silu_dx_kernel, (N * nsb * cb,), x, dy, dy1, dx, scale, shift, mean, invstd, *sums,
                   N * S, C, cb, S, nsb, *x.stride(), *dy.stride(), *dy1.stride(), split, *dx.stride(),
                   TRAINING=ctx.training, BR=cfg.rows, BC=cfg.channels, num_warps=cfg.num_warps,
                   **flags(cfg, C, S, x.stride(), dy.stride(), dy1.stride(), dx.stride(), split=split))
        if dx is not None:
            dx = dx.view(shape)
        autograd = weight is not None and not direct  # else the kernel wrote them
        dw = sums[0].to(weight.dtype) if autograd and ctx.needs_input_grad[1] else None
        db = sums[1].to(weight.dtype) if autograd and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None, None


_apply = applier(_BatchNormSiLU)


Tensor = torch.Tensor


def batch_norm_silu_torch(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                          weight: Tensor | None = None, bias: Tensor | None = None,
                          training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """:func:`batch_norm_silu` as torch runs it: ``silu(batch_norm(...))``, the reference of the
    tests and the path of CPUs and float64."""
    return F.silu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps))


def check(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None,
          bias: Tensor | None, training: bool, fn: str = "batch_norm_silu",
          num_batches_tracked: Tensor | None = None) -> None:
    """Raise ``ValueError`` naming the argument (and ``fn``) where the arguments are not what
    ``F.batch_norm`` takes (and ``num_batches_tracked`` not a one-element int64 tensor on ``x``'s
    device)."""
    t = num_batches_tracked
    if t is not None and not (isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype == torch.long
                              and t.device == x.device):
        got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{fn}: num_batches_tracked must be a one-element int64 tensor on {x.device} (a "
                         f"BatchNorm's counter); got {got}")
    if x.dim() < 2:
        raise ValueError(f"{fn}: x must be (N, C, ...); got shape {tuple(x.shape)}")
    C = x.shape[1]
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):
        if t is not None and (tuple(t.shape) != (C,) or t.device != x.device):
            raise ValueError(f"{fn}: {name} must be a ({C},) tensor on {x.device} (x's channels); got "
                             f"{tuple(t.shape)} on {t.device}")
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{fn}: running_mean and running_var must be given together")
    if (weight is None) != (bias is None):
        raise ValueError(f"{fn}: weight and bias must be given together (an affine BatchNorm) or neither")
    if not training and running_mean is None:
        raise ValueError(f"{fn}: training=False normalizes with the running statistics: pass running_mean "
                         "and running_var")
    if training and x.numel() // max(C, 1) == 1:
        raise ValueError(f"{fn}: expected more than 1 value per channel when training, got input size "
                         f"{tuple(x.shape)}")


def batch_norm_silu(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                    weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                    momentum: float = 0.1, eps: float = 1e-5, *,
                    num_batches_tracked: Tensor | None = None) -> Tensor:
    """``silu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps))``
    (the module docstring): the same arguments, the running statistics updated in place alike.

    Args:
        x: ``(N, C, ...)`` activations, float16, bfloat16, float32 (float64 takes torch's path),
            contiguous or channels_last.
        running_mean, running_var: ``(C,)`` running statistics, or None (training only).
        weight, bias: ``(C,)`` affine parameters, or None.
        training: normalize with the batch's statistics (and move the running ones by
            ``momentum``), else with the running ones.
        momentum: the running statistics' step (a float, as ``nn.BatchNorm2d`` passes).
        eps: added to the variance.
        num_batches_tracked: a BatchNorm module's counter, 1 added to it (what the module's forward
            does before ``F.batch_norm`` in training), inside the statistics' launch.

    Returns:
        ``y`` in ``x``'s dtype and memory format.
    """
    check(x, running_mean, running_var, weight, bias, training, num_batches_tracked=num_batches_tracked)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.numel() == 0 or not use_triton(
            x.device):
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        return batch_norm_silu_torch(x, running_mean, running_var, weight, bias, training, momentum, eps)
    return _apply(x, weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps),
                  False, num_batches_tracked)


def split_batch_norm_silu(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                          weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                          momentum: float = 0.1, eps: float = 1e-5, *,
                          num_batches_tracked: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`batch_norm_silu` of a 4-d ``x`` with an even number of channels, as its two channel
    halves (``y.chunk(2, 1)``), each a dense tensor of its own in ``x``'s memory format: what a C2f
    block's ``cv1`` hands its bottlenecks, which would otherwise copy their strided half before
    convolving it (channels_last). The statistics are the whole op's; the backward reads the two
    halves' grads where they are, with no copy side by side (the kernels take the second part's
    address and strides). Where :func:`batch_norm_silu` takes torch's path, the halves are
    ``chunk``'s views."""
    check(x, running_mean, running_var, weight, bias, training, num_batches_tracked=num_batches_tracked)
    if x.dim() != 4 or x.shape[1] % 2:
        raise ValueError(f"split_batch_norm_silu: x must be (N, C, H, W) with an even C; got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.numel() == 0 or not use_triton(
            x.device):
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        return tuple(batch_norm_silu_torch(x, running_mean, running_var, weight, bias, training, momentum,
                                           eps).chunk(2, 1))
    return _apply(x, weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps),
                  True, num_batches_tracked)


__all__ = ["batch_norm_silu", "batch_norm_silu_torch", "check", "bn_silu_apply_kernel", "bn_silu_dx_kernel",
           "bn_silu_grad_sums_kernel", "split_batch_norm_silu"]
