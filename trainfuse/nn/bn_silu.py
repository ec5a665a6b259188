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
and a sum of squared deviations per channel (Chan's merge of chunk statistics, no ``E[x^2] - E[x]^2``
cancellation); the last program of each channel block to arrive (an arrival counter per block)
merges the block's partials in a fixed order, updates the running statistics and writes ``s`` and
``t``; a second pass writes ``y``. Backward: partial sums of ``du`` and ``du xhat`` and, by the
last to arrive, their fixed-order total, then ``dx``, ``u`` recomputed from ``x`` both times. No
program adds into another's output, and the totals' order does not depend on which program
arrives last: the same inputs give the same bits in every run, eager or replayed from a CUDA
graph. A tile's addresses are one scalar per tile plus offsets made once per program
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

import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.function import applier
from trainfuse._runtime.launch import CachedLauncher, cdiv, next_power_of_2, stream_workspace
from trainfuse._runtime.reduce import last_to_arrive
from trainfuse.nn import channel_tiles as tiles


@dataclasses.dataclass
class BNLaunch:
    """A tile is ``rows`` spatial positions of one image by ``channels`` channels, long along the
    dimension that is contiguous in memory (a tile never crosses an image, so the compiler sees
    that contiguity); a reduction program walks ``programs_per_sm`` of the GPU's share of the
    tiles, ``unroll`` tiles' loads issued before their math. ``reduce`` is the two reduction
    kernels' own tile where it differs from the elementwise kernels' (None: the same). Tests shrink
    the tiles so that small inputs span several programs."""

    rows: int
    channels: int
    num_warps: int = 4
    programs_per_sm: int = 4
    unroll: int = 1
    reduce: BNLaunch | None = None


CONTIGUOUS = BNLaunch(rows=256, channels=16)  # NCHW: a channel's positions are contiguous
# NHWC: a position's channels are contiguous. On an H200, over yolo11m's 106 BatchNorms at batch 16
# and 640 px (2.2 GB of float16 activations), two tiles in flight cut the statistics from 1.71 to
# 1.54 ms and the grad sums from 2.47 to 2.26 ms (four, more programs per SM, wider or longer
# tiles: slower); 32 x 64 elementwise tiles cut dx from 2.33 to 2.25 ms
CHANNELS_LAST = BNLaunch(rows=32, channels=64, reduce=BNLaunch(rows=64, channels=32, unroll=2))


@triton.jit
def bn_stats_kernel(x_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, w_ptr, b_ptr, rmean_ptr, rvar_ptr,
                    scale_ptr, shift_ptr, save_mean_ptr, save_invstd_ptr, C, CB, S, NSB, Q, sN, sC, sS,
                    tiles_per_program, P, M, momentum, eps, HAS_W: tl.constexpr, UPDATE: tl.constexpr,
                    BP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, UNROLL: tl.constexpr,
                    EVEN_S: tl.constexpr, MASKED: tl.constexpr, REL32: tl.constexpr):
    """Program ``(i, j)`` (``i * CB + j``): tiles ``[i * tiles_per_program, ...)`` of channel block
    ``j`` -> their count, mean and summed squared deviations per channel at ``[i, c]``. Each tile
    element sums ``x - k`` and its square on its own (no reduction and no division inside the
    loop, so the loads stream), reduced across the tile once at the end. The shift ``k`` is the
    channel's value at the program's first position: a sample of the channel, so the sums cancel
    only as much as the data's own spread around its mean (the summed squares minus the squared
    sum lose ``((mean - k) / std)**2`` ulps of the variance, a few for any sample). The loop walks
    the program's own tiles (``UNROLL`` at a time, the rest one by one); where the positions fill
    whole tiles (``EVEN_S``) it neither masks them nor counts them one by one. The last of channel
    block ``j``'s ``P`` programs to arrive merges their partials (:func:`_finalize`) and re-arms
    the block's arrival counter."""
    i, j, c = tiles.program(CB, BC)
    cm = c < C
    q0 = i * tiles_per_program  # always a tile (the launch makes no program without one)
    valid = tl.minimum(tiles_per_program, Q - q0)
    rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
    first, _ = tiles.tile_start(q0, NSB, sN, sS, BR)
    k = tl.load(x_ptr + first + c.to(tl.int64) * sC, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.zeros([BR, BC], tl.float32)
    s2 = tl.zeros([BR, BC], tl.float32)
    count = tl.zeros([BR, BC], tl.float32)
    grouped = valid // UNROLL * UNROLL
    for t0 in range(0, grouped, UNROLL):
        for t1 in tl.static_range(UNROLL):  # UNROLL tiles' loads in flight at once
            d, m = _deviations(x_ptr, q0 + t0 + t1, rel, k, cm, S, NSB, sN, sS, BR, EVEN_S, MASKED)
            s1 += d
            s2 += d * d
            if not EVEN_S:
                count += m.to(tl.float32)
    for t in range(grouped, valid):
        d, m = _deviations(x_ptr, q0 + t, rel, k, cm, S, NSB, sN, sS, BR, EVEN_S, MASKED)
        s1 += d
        s2 += d * d
        if not EVEN_S:
            count += m.to(tl.float32)
    if EVEN_S:  # every position of every tile: the count is the host's
        n = tl.zeros([BC], tl.float32) + (valid * BR).to(tl.float32)
    else:
        n = tl.sum(count, 0)
    s1 = tl.sum(s1, 0)
    s2 = tl.sum(s2, 0)
    inv = 1.0 / tl.maximum(n, 1.0)
    tl.store(mean_ptr + i * C + c, k + s1 * inv, mask=cm)
    tl.store(m2_ptr + i * C + c, tl.maximum(s2 - s1 * s1 * inv, 0.0), mask=cm)
    tl.store(count_ptr + i * C + c, n, mask=cm)
    tl.debug_barrier()  # every thread's partials are stored before the release below
    if last_to_arrive(cnt_ptr + j, P):
        _finalize(mean_ptr, m2_ptr, count_ptr, w_ptr, b_ptr, rmean_ptr, rvar_ptr, scale_ptr, shift_ptr,
                  save_mean_ptr, save_invstd_ptr, c, cm, P, M, C, momentum, eps, HAS_W, UPDATE, BP, BC)
        tl.store(cnt_ptr + j, 0)  # re-armed for the next launch on this stream


@triton.jit
def _deviations(x_ptr, q, rel, k, cm, S, NSB, sN, sS, BR: tl.constexpr, EVEN_S: tl.constexpr,
                MASKED: tl.constexpr):
    """Tile ``q``'s ``x - k`` (0 at positions past ``S``; another channel's masked element is
    never stored) and its mask."""
    base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
    m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
    d = tiles.load_tile(x_ptr + base + rel, m, MASKED) - k[None, :]
    if not EVEN_S:
        d = tl.where(m, d, 0.0)
    return d, m


@triton.jit
def _finalize(mean_ptr, m2_ptr, count_ptr, w_ptr, b_ptr, rmean_ptr, rvar_ptr, scale_ptr, shift_ptr,
              save_mean_ptr, save_invstd_ptr, c, cm, P, M, C, momentum, eps,
              HAS_W: tl.constexpr, UPDATE: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
    """Channels ``c``: the ``P`` partials merged in a fixed order (``BP`` rows at a time, then
    across the rows) -> the batch's mean and 1/std, ``s`` and ``t``, and the running statistics
    moved by ``momentum`` (``UPDATE``). Two passes over the partials (a few KB, read past the
    SM's cache: other programs wrote them): the mean of the partial means weighted by their
    counts, then each partial's squared deviations plus its count times its mean's squared
    distance from that mean (Chan's merge, summed at once: plain sums, which the interpreter runs
    as numpy where a custom ``tl.reduce`` runs element by element)."""
    weighted = tl.zeros([BP, BC], tl.float32)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        m = (p < P)[:, None] & cm[None, :]
        offsets = p[:, None] * C + c[None, :]
        n = tl.load(count_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
        weighted += n * tl.load(mean_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
    mean = tl.sum(weighted, 0) / M
    deviations = tl.zeros([BP, BC], tl.float32)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        m = (p < P)[:, None] & cm[None, :]
        offsets = p[:, None] * C + c[None, :]
        n = tl.load(count_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
        d = tl.load(mean_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg") - mean[None, :]
        deviations += tl.load(m2_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg") + n * d * d
    m2 = tl.sum(deviations, 0)
    invstd = 1.0 / tl.sqrt(m2 / M + eps)
    if HAS_W:
        scale = tl.load(w_ptr + c, mask=cm, other=1.0).to(tl.float32) * invstd
        shift = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32) - mean * scale
    else:
        scale = invstd
        shift = -mean * invstd
    tl.store(scale_ptr + c, scale, mask=cm)
    tl.store(shift_ptr + c, shift, mask=cm)
    tl.store(save_mean_ptr + c, mean, mask=cm)
    tl.store(save_invstd_ptr + c, invstd, mask=cm)
    if UPDATE:
        rmean = tl.load(rmean_ptr + c, mask=cm, other=0.0)
        rvar = tl.load(rvar_ptr + c, mask=cm, other=0.0)
        new_mean = (1.0 - momentum) * rmean.to(tl.float32) + momentum * mean
        new_var = (1.0 - momentum) * rvar.to(tl.float32) + momentum * (m2 / (M - 1))
        tl.store(rmean_ptr + c, new_mean.to(rmean.dtype), mask=cm)
        tl.store(rvar_ptr + c, new_var.to(rvar.dtype), mask=cm)


@triton.jit
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


@triton.jit
def _du(x, dy, s, t):
    """``u`` recomputed and SiLU's backward: ``dy silu'(u)``."""
    u = x * s[None, :] + t[None, :]
    sig = tl.sigmoid(u)
    return dy * sig * (1.0 + u * (1.0 - sig))


@triton.jit
def _du_tile(x_ptr, dy_ptr, dy1_ptr, gp, gN_, gS_, rel, rel_g, q, c, cm, s, t, S, NSB, sN, sS, gN, gC, gS,
             hN, hC, hS, SPLIT, BR: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr,
             PART: tl.constexpr):
    """Tile ``q``'s ``x`` and ``du`` (0 where masked): ``dy`` at ``gp`` (strides ``gN_, gS_``,
    offsets ``rel_g``) for a block in one part, else split by channel."""
    base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
    m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
    x = tiles.load_tile(x_ptr + base + rel, m, MASKED)
    if PART == 2:
        grads = tiles.split_addresses(dy_ptr, dy1_ptr, q, c, NSB, gN, gC, gS, hN, hC, hS, SPLIT, BR)
    else:
        gbase, _ = tiles.tile_start(q, NSB, gN_, gS_, BR)
        grads = gp + gbase + rel_g
    du = _du(x, tiles.load_tile(grads, m, MASKED), s, t)
    if MASKED:
        du = tl.where(m, du, 0.0)
    return x, du


@triton.jit
def bn_silu_grad_sums_kernel(x_ptr, dy_ptr, dy1_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, sdu_ptr,
                             sdux_ptr, cnt_ptr, dw_ptr, db_ptr, C, CB, S, NSB, Q, sN, sC, sS, gN, gC, gS, hN,
                             hC, hS, SPLIT, tiles_per_program, P, BP: tl.constexpr, BR: tl.constexpr,
                             BC: tl.constexpr, UNROLL: tl.constexpr, EVEN_S: tl.constexpr,
                             MASKED: tl.constexpr, PART: tl.constexpr, REL32: tl.constexpr,
                             G_SAME: tl.constexpr):
    """Program ``(i, j)`` (``i * CB + j``): its tiles' sums of ``du`` and ``du xhat`` per channel
    at ``[i, c]``; the last of channel block ``j``'s ``P`` programs to arrive adds them up in a
    fixed order into ``dw`` and ``db``. ``dy``'s channels from ``SPLIT`` on are ``dy1``'s (C, and
    ``dy`` again, for one part); the tiles walked as the statistics walk them. ``G_SAME``: one
    part laid out as ``x``, read at ``x``'s offsets."""
    i, j, c = tiles.program(CB, BC)
    cm = c < C
    s = tl.load(scale_ptr + c, mask=cm, other=0.0)
    t = tl.load(shift_ptr + c, mask=cm, other=0.0)
    mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
    invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
    q0 = i * tiles_per_program
    valid = tl.minimum(tiles_per_program, Q - q0)
    rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
    if PART == 1:
        gp, gN_, gC_, gS_, cg = tiles.block_part(j, c, SPLIT, dy_ptr, dy1_ptr, gN, gC, gS, hN, hC, hS, BC)
    else:  # (PART 2 reads its addresses tile by tile)
        gp, gN_, gC_, gS_, cg = dy_ptr, gN, gC, gS, c
    if G_SAME:  # dy laid out as x: the same offsets (fewer registers held across the loop)
        rel_g = rel
    else:
        rel_g = tiles.tile_offsets(cg, gC_, gS_, BR, REL32)
    sdu = tl.zeros([BR, BC], tl.float32)
    sdux = tl.zeros([BR, BC], tl.float32)
    grouped = valid // UNROLL * UNROLL
    for k0 in range(0, grouped, UNROLL):
        for k1 in tl.static_range(UNROLL):  # UNROLL tiles' loads in flight at once
            x, du = _du_tile(x_ptr, dy_ptr, dy1_ptr, gp, gN_, gS_, rel, rel_g, q0 + k0 + k1, c, cm, s, t, S,
                             NSB, sN, sS, gN, gC, gS, hN, hC, hS, SPLIT, BR, EVEN_S, MASKED, PART)
            sdu += du
            sdux += du * (x - mean[None, :])
    for k in range(grouped, valid):
        x, du = _du_tile(x_ptr, dy_ptr, dy1_ptr, gp, gN_, gS_, rel, rel_g, q0 + k, c, cm, s, t, S, NSB, sN,
                         sS, gN, gC, gS, hN, hC, hS, SPLIT, BR, EVEN_S, MASKED, PART)
        sdu += du
        sdux += du * (x - mean[None, :])
    tl.store(sdu_ptr + i * C + c, tl.sum(sdu, 0), mask=cm)
    tl.store(sdux_ptr + i * C + c, tl.sum(sdux, 0) * invstd, mask=cm)
    tl.debug_barrier()  # every thread's partials are stored before the release below
    if last_to_arrive(cnt_ptr + j, P):
        _grad_finalize(sdu_ptr, sdux_ptr, dw_ptr, db_ptr, c, cm, P, C, BP, BC)
        tl.store(cnt_ptr + j, 0)  # re-armed for the next launch on this stream


@triton.jit
def _grad_finalize(sdu_ptr, sdux_ptr, dw_ptr, db_ptr, c, cm, P, C, BP: tl.constexpr, BC: tl.constexpr):
    """Channels ``c``: the ``P`` partial sums added in a fixed order -> ``dw = sum du xhat``,
    ``db = sum du``."""
    sdu = tl.zeros([BP, BC], tl.float32)
    sdux = tl.zeros([BP, BC], tl.float32)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        m = (p < P)[:, None] & cm[None, :]
        offsets = p[:, None] * C + c[None, :]
        sdu += tl.load(sdu_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
        sdux += tl.load(sdux_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
    sdu = tl.sum(sdu, 0)
    sdux = tl.sum(sdux, 0)
    tl.store(db_ptr + c, sdu, mask=cm)
    tl.store(dw_ptr + c, sdux, mask=cm)


@triton.jit
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
    du = _du(x, tiles.load_tile(grads, m, MASKED), s, t)
    if TRAINING:
        mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
        invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
        dw = tl.load(dw_ptr + c, mask=cm, other=0.0)
        db = tl.load(db_ptr + c, mask=cm, other=0.0)
        xhat = (x - mean[None, :]) * invstd[None, :]
        du = du - db[None, :] / M - xhat * (dw[None, :] / M)
    dbase, _ = tiles.tile_start(q, NSB, dN, dS, BR)
    tiles.store_tile(dx_ptr + dbase + tiles.tile_offsets(c, dC, dS, BR, REL32), du * s[None, :], m, MASKED)


FINALIZE_ROWS = 64  # the partials the last program to arrive reads at a time
launcher = CachedLauncher()  # a launch from raw addresses: an eager step pays little host time a block


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` (N, C, *spatial) as ``(N, C, S)``: a view where the spatial strides merge (contiguous,
    channels_last), else a contiguous copy to read from."""
    return t.reshape(t.shape[0], t.shape[1], -1)


def _config(strides: tuple[int, int, int], C: int, reduce: bool = False) -> BNLaunch:
    """The layout's tile (the reductions' with ``reduce``), its channels cut to ``C``'s power of two
    (at least 16) where ``C`` is smaller and its rows grown to keep the tile's size: a 16-channel
    layer in channels_last then wastes no lanes."""
    cfg = CHANNELS_LAST if strides[1] == 1 else CONTIGUOUS
    if reduce and cfg.reduce is not None:
        cfg = cfg.reduce
    channels = min(cfg.channels, max(16, next_power_of_2(C)))
    if channels == cfg.channels:
        return cfg
    return BNLaunch(cfg.rows * cfg.channels // channels, channels, cfg.num_warps, cfg.programs_per_sm,
                    cfg.unroll, cfg.reduce)


def _flags(cfg: BNLaunch, C: int, S: int, *strides: tuple[int, ...], split: int | None = None) -> dict:
    """A launch's shape constexprs: the positions fill whole tiles (``EVEN_S``); some element is
    masked (``MASKED``: a partial tile or channel block); with ``split``, where a channel block
    lies against it (``PART``: 0 one part, 1 the split at a multiple of the block, 2 anywhere);
    every tile's offsets from its first element fit 32 bits (``REL32``) for each ``(N, C, S)``
    stride triple given."""
    even_s = S % cfg.rows == 0
    width = cdiv(C, cfg.channels) * cfg.channels
    flags = dict(EVEN_S=even_s, MASKED=not (even_s and C % cfg.channels == 0),
                 REL32=all((cfg.rows - 1) * st[2] + (width - 1) * st[1] < 2**31 for st in strides))
    if split is not None:
        flags["PART"] = 0 if split >= C else 1 if split % cfg.channels == 0 else 2
    return flags


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device) -> int:
    """Reduction programs to spread over the device (4 SMs' worth under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _split(tiles: int, channel_blocks: int, device: torch.device, cfg: BNLaunch) -> tuple[int, int]:
    """``(P, tiles_per_program)``: the tiles split over the reduction programs."""
    want = max(1, _programs(device) * cfg.programs_per_sm // channel_blocks)
    per = cdiv(tiles, want)
    return cdiv(tiles, per), per


COUNTERS = 256  # arrival counters asked for at least (4,096 channels in blocks of 16)


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` arrival counters at zero, the current stream's (kernels on a stream run in order, and
    the last program of each channel block re-arms its counter). At least :data:`COUNTERS`, so
    that the stream's set is made once, not grown layer by layer (a CUDA graph keeps the
    addresses it was captured with)."""
    return stream_workspace(device, None, torch.float32, 0, max(n, COUNTERS))[1]


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
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, split=False):
        shape = x.shape
        x = _flat(x)
        N, C, S = x.shape
        cfg = _config(x.stride(), C)
        cb = cdiv(C, cfg.channels)
        nsb = cdiv(S, cfg.rows)
        consts = torch.empty(4, C, device=x.device, dtype=torch.float32)  # scale, shift, mean, invstd
        scale, shift, mean, invstd = consts.unbind(0)
        has_w = weight is not None
        if training:
            rc = _config(x.stride(), C, reduce=True)
            rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
            P, per = _split(N * rnsb, rcb, x.device, rc)
            partials = torch.empty(3, P, C, device=x.device, dtype=torch.float32)  # mean, m2, count
            update = running_mean is not None
            affine = (weight, bias) if has_w else (consts, consts)  # (unread without HAS_W)
            running = (running_mean, running_var) if update else (consts, consts)  # (unread without UPDATE)
            launcher(bn_stats_kernel, (P * rcb,), x, *partials, _counters(x.device, rcb), *affine, *running,
                     scale, shift, mean, invstd, C, rcb, S, rnsb, N * rnsb, *x.stride(), per, P, N * S,
                     momentum, eps, HAS_W=has_w, UPDATE=update, BP=FINALIZE_ROWS, BR=rc.rows, BC=rc.channels,
                     UNROLL=rc.unroll, num_warps=rc.num_warps, **_flags(rc, C, S, x.stride()))
        else:  # the running statistics' constants: a few (C,) operations
            mean.copy_(running_mean)
            torch.rsqrt(running_var.float() + eps, out=invstd)
            scale.copy_(invstd * weight if has_w else invstd)
            shift.copy_((bias - mean * scale) if has_w else -mean * scale)
        ctx.save_for_backward(x, weight, consts)
        ctx.training, ctx.split, ctx.shape = training, split, shape
        if split:  # two outputs, each dense: C2f's halves (split_batch_norm_silu)
            y0, y1, part = _halves(x.view(shape))
            ys = _flat(y0).stride()
            launcher(bn_silu_apply_kernel, (N * nsb * cb,), x, y0, scale, shift, C, cb, S, nsb, *x.stride(),
                     *ys, C // 2, part, BR=cfg.rows, BC=cfg.channels, num_warps=cfg.num_warps,
                     **_flags(cfg, C, S, x.stride(), ys, split=C // 2))
            return y0, y1
        y = torch.empty_like(x)  # x's strides: channels_last stays channels_last
        launcher(bn_silu_apply_kernel, (N * nsb * cb,), x, y, scale, shift, C, cb, S, nsb, *x.stride(),
                 *y.stride(), C, 0, BR=cfg.rows, BC=cfg.channels, num_warps=cfg.num_warps,
                 **_flags(cfg, C, S, x.stride(), y.stride(), split=C))
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy, dy1=None):
        x, weight, consts = ctx.saved_tensors
        scale, shift, mean, invstd = consts.unbind(0)
        shape = ctx.shape
        N, C, S = x.shape
        # the halves' grads read where they are (an unused half's comes as zeros: the Function
        # materializes it); one part: the second is the first, from channel C on (none)
        dy = _flat(dy)
        dy1, split = (_flat(dy1), C // 2) if ctx.split else (dy, C)
        rc = _config(x.stride(), C, reduce=True)
        rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
        P, per = _split(N * rnsb, rcb, x.device, rc)
        partials = torch.empty(2, P, C, device=x.device, dtype=torch.float32)
        sums = torch.empty(2, C, device=x.device, dtype=torch.float32)  # dw, db
        launcher(bn_silu_grad_sums_kernel, (P * rcb,), x, dy, dy1, scale, shift, mean, invstd, *partials,
                 _counters(x.device, rcb), *sums, C, rcb, S, rnsb, N * rnsb, *x.stride(), *dy.stride(),
                 *dy1.stride(), split, per, P, BP=FINALIZE_ROWS, BR=rc.rows, BC=rc.channels,
                 UNROLL=rc.unroll, num_warps=rc.num_warps, G_SAME=split >= C and dy.stride() == x.stride(),
                 **_flags(rc, C, S, x.stride(), dy.stride(), dy1.stride(), split=split))
        cfg = _config(x.stride(), C)
        cb = cdiv(C, cfg.channels)
        nsb = cdiv(S, cfg.rows)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x)
            launcher(bn_silu_dx_kernel, (N * nsb * cb,), x, dy, dy1, dx, scale, shift, mean, invstd, *sums,
                     N * S, C, cb, S, nsb, *x.stride(), *dy.stride(), *dy1.stride(), split, *dx.stride(),
                     TRAINING=ctx.training, BR=cfg.rows, BC=cfg.channels, num_warps=cfg.num_warps,
                     **_flags(cfg, C, S, x.stride(), dy.stride(), dy1.stride(), dx.stride(), split=split))
            dx = dx.view(shape)
        dw = sums[0].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = sums[1].to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None


_apply = applier(_BatchNormSiLU)


Tensor = torch.Tensor


def batch_norm_silu_torch(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                          weight: Tensor | None = None, bias: Tensor | None = None,
                          training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """:func:`batch_norm_silu` as torch runs it: ``silu(batch_norm(...))``, the reference of the
    tests and the path of CPUs and float64."""
    return F.silu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps))


def _check(x, running_mean, running_var, weight, bias, training) -> None:
    fn = "batch_norm_silu"
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
                    momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
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

    Returns:
        ``y`` in ``x``'s dtype and memory format.
    """
    _check(x, running_mean, running_var, weight, bias, training)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.numel() == 0 or not use_triton(
            x.device):
        return batch_norm_silu_torch(x, running_mean, running_var, weight, bias, training, momentum, eps)
    return _apply(x, weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps))


def split_batch_norm_silu(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                          weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                          momentum: float = 0.1, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """:func:`batch_norm_silu` of a 4-d ``x`` with an even number of channels, as its two channel
    halves (``y.chunk(2, 1)``), each a dense tensor of its own in ``x``'s memory format: what a C2f
    block's ``cv1`` hands its bottlenecks, which would otherwise copy their strided half before
    convolving it (channels_last). The statistics are the whole op's; the backward reads the two
    halves' grads where they are, with no copy side by side (the kernels take the second part's
    address and strides). Where :func:`batch_norm_silu` takes torch's path, the halves are
    ``chunk``'s views."""
    _check(x, running_mean, running_var, weight, bias, training)
    if x.dim() != 4 or x.shape[1] % 2:
        raise ValueError(f"split_batch_norm_silu: x must be (N, C, H, W) with an even C; got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.numel() == 0 or not use_triton(
            x.device):
        return tuple(batch_norm_silu_torch(x, running_mean, running_var, weight, bias, training, momentum,
                                           eps).chunk(2, 1))
    return _apply(x, weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps),
                  True)


__all__ = ["BNLaunch", "batch_norm_silu", "batch_norm_silu_torch", "bn_silu_apply_kernel",
           "bn_silu_dx_kernel", "bn_silu_grad_sums_kernel", "bn_stats_kernel", "split_batch_norm_silu"]
