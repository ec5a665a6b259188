"""What every channel-wise BatchNorm kernel of :mod:`trainfuse.nn` shares: the launch shapes
(:class:`BNLaunch` tiles, their constexpr flags, the reduction programs and their arrival
counters), the statistics pass (:func:`statistics`: one launch, Chan's merge by the last program
to arrive; the math in :mod:`trainfuse.nn.bn_silu`'s docstring), and the backward's SiLU and
fixed-order sums."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from trainfuse._runtime.launch import CachedLauncher, cdiv, next_power_of_2, stream_workspace
from trainfuse._runtime.reduce import last_to_arrive
from trainfuse.nn import channel_tiles as tiles


@dataclasses.dataclass
class BNLaunch:
    """A tile is ``rows`` spatial positions of one image by ``channels`` channels, long along the
    dimension that is contiguous in memory (a tile never crosses an image, so the compiler sees
    that contiguity); a reduction program walks ``programs_per_sm`` of the GPU's share of the
    tiles, ``unroll`` tiles' loads issued before their math. ``reduce`` is the two reduction
    kernels' own tile where it differs from the elementwise kernels' (None: the same);
    ``partials``, where set, caps a channel block's reduction programs (their partials are what its
    last program adds up alone). Tests shrink the tiles so that small inputs span several programs."""

    rows: int
    channels: int
    num_warps: int = 4
    programs_per_sm: int = 4
    unroll: int = 1
    reduce: BNLaunch | None = None
    partials: int = 0


CONTIGUOUS = BNLaunch(rows=256, channels=16)  # NCHW: a channel's positions are contiguous
# NHWC: a position's channels are contiguous. On an H200, over yolo11m's 106 BatchNorms at batch 16
# and 640 px (2.2 GB of float16 activations), two tiles in flight cut the statistics from 1.71 to
# 1.54 ms and the grad sums from 2.47 to 2.26 ms (four, more programs per SM, wider or longer
# tiles: slower); 32 x 64 elementwise tiles cut dx from 2.33 to 2.25 ms. With the one-pass merge
# (statistics 1.41 ms, grad sums 2.10), four tiles in flight, 8 warps, 128 x 32 or 32 x 64 tiles,
# 8 programs per SM and a cap of 64 partials per block each measured 0.2 to 1.0 ms slower
CHANNELS_LAST = BNLaunch(rows=32, channels=64, reduce=BNLaunch(rows=64, channels=32, unroll=2))


def _reduce_from_env(layout: BNLaunch) -> BNLaunch:
    """``TRAINFUSE_BN_REDUCE=ROWSxCHANNELSxUNROLLxPROGRAMS_PER_SMxWARPS[xPARTIALS]`` (e.g.
    ``64x32x2x4x4``) overrides ``layout``'s reduction tile, for tuning on other GPUs."""
    spec = os.environ.get("TRAINFUSE_BN_REDUCE", "")
    if not spec:
        return layout
    want = "ROWSxCHANNELSxUNROLLxPROGRAMS_PER_SMxWARPS[xPARTIALS], e.g. 64x32x2x4x4"
    try:
        values = [int(v) for v in spec.lower().split("x")]
    except ValueError:
        raise ValueError(f"TRAINFUSE_BN_REDUCE={spec!r}: expected {want}") from None
    if len(values) not in (5, 6) or min(values[:5]) < 1 or any(v & (v - 1) for v in (*values[:2], values[4])):
        raise ValueError(f"TRAINFUSE_BN_REDUCE={spec!r}: expected {want} (rows, channels and warps powers "
                         "of two, all but the partials at least 1)")
    rows, channels, unroll, per_sm, warps, *partials = values
    return dataclasses.replace(layout, reduce=BNLaunch(rows, channels, warps, per_sm, unroll,
                                                       partials=partials[0] if partials else 0))


CHANNELS_LAST = _reduce_from_env(CHANNELS_LAST)


@triton.jit(do_not_specialize=["CB", "NSB", "Q", "tiles_per_program", "P", "M"])
def bn_stats_kernel(x_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, w_ptr, b_ptr, rmean_ptr, rvar_ptr, scale_ptr,
                    shift_ptr, save_mean_ptr, save_invstd_ptr, tracked_ptr, C, CB, S, NSB, Q, sN, sC, sS,
                    tiles_per_program, P, M, momentum, eps, HAS_W: tl.constexpr, UPDATE: tl.constexpr,
                    TRACK: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                    UNROLL: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, REL32: tl.constexpr):
    """Program ``(i, j)`` (``i * CB + j``): tiles ``[i * tiles_per_program, ...)`` of channel block
    ``j`` -> their count, mean and summed squared deviations per channel at ``[i, c]``. Each tile
    element sums ``x - k`` and its square on its own (no reduction and no division inside the
    loop, so the loads stream), reduced across the tile once at the end. The shift ``k`` is the
    channel's value at the program's first position: a sample of the channel, so the sums cancel
    only as much as the data's own spread around its mean (the summed squares minus the squared
    sum lose ``((mean - k) / std)**2`` ulps of the variance, a few for any sample; each program its
    own sample, so one atypical value, a padded corner of a convolution's output, spoils one
    program's partial at most). The loop walks the program's own tiles (``UNROLL`` at a time, the
    rest one by one); where the positions fill whole tiles (``EVEN_S``) it neither masks them nor
    counts them one by one. The last of channel block ``j``'s ``P`` programs to arrive merges
    their partials in one pass (:func:`merge_partials`), writes the constants (:func:`_finalize`)
    and re-arms the block's arrival counter; block 0's also adds 1 to the module's
    ``num_batches_tracked`` (``TRACK``)."""
    i, j, c = tiles.program(CB, BC)
    stats_program(x_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, w_ptr, b_ptr, rmean_ptr, rvar_ptr, scale_ptr,
                  shift_ptr, save_mean_ptr, save_invstd_ptr, tracked_ptr, i, j, c, C, S, NSB, Q, sN, sC, sS,
                  tiles_per_program, P, M, momentum, eps, HAS_W, UPDATE, TRACK, BP, BR, BC, UNROLL, EVEN_S,
                  MASKED, REL32)


@triton.jit
def stats_program(x_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, w_ptr, b_ptr, rmean_ptr, rvar_ptr, scale_ptr,
                  shift_ptr, save_mean_ptr, save_invstd_ptr, tracked_ptr, i, j, c, C, S, NSB, Q, sN, sC, sS,
                  tiles_per_program, P, M, momentum, eps, HAS_W: tl.constexpr, UPDATE: tl.constexpr,
                  TRACK: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                  UNROLL: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, REL32: tl.constexpr):
    """Program ``(i, j)``'s part of :func:`bn_stats_kernel` (its partials; the merge and the
    constants where it arrives last); returns whether it arrived last."""
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
    last = last_to_arrive(cnt_ptr + j, P)
    if last:
        mean, m2 = merge_partials(mean_ptr, m2_ptr, count_ptr, c, cm, P, C, BP, BC)
        _finalize(mean, m2, w_ptr, b_ptr, rmean_ptr, rvar_ptr, scale_ptr, shift_ptr, save_mean_ptr,
                  save_invstd_ptr, c, cm, M, momentum, eps, HAS_W, UPDATE)
        if TRACK:
            if j == 0:
                tl.store(tracked_ptr, tl.load(tracked_ptr) + 1)
        tl.store(cnt_ptr + j, 0)  # re-armed for the next launch on this stream
    return last


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
def _partial_stats(mean_ptr, m2_ptr, count_ptr, p, c, cm, P, C):
    """Partials ``p`` (rows past ``P``: zeros, nothing read) of channels ``c``: count, mean, m2."""
    m = (p < P)[:, None] & cm[None, :]
    offsets = p[:, None] * C + c[None, :]
    n = tl.load(count_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
    mu = tl.load(mean_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
    m2 = tl.load(m2_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
    return n, mu, m2


@triton.jit
def merge_partials(mean_ptr, m2_ptr, count_ptr, c, cm, P, C, BP: tl.constexpr, BC: tl.constexpr):
    """Channels ``c``: the ``P`` partial (count, mean, m2) rows merged in a fixed order, in one
    pass -> the mean and the summed squared deviations of all of them. Lane ``r`` of a ``BP``-row
    block merges rows ``r``, ``r + BP``, ... into its own running partial as it reads them (Chan's
    pairwise merge, elementwise: no reduction inside the loop), the next rows' loads issued before
    the current ones are merged (read past the SM's cache: other programs wrote them); then the
    lanes' partials are merged at once (the mean of their means weighted by their counts, then
    their squared deviations plus each count times its mean's squared distance from that mean:
    plain sums, which the interpreter runs as numpy where a custom ``tl.reduce`` runs element by
    element)."""
    rows = tl.arange(0, BP)
    n_acc = tl.zeros([BP, BC], tl.float32)
    mean_acc = tl.zeros([BP, BC], tl.float32)
    m2_acc = tl.zeros([BP, BC], tl.float32)
    n, mu, m2 = _partial_stats(mean_ptr, m2_ptr, count_ptr, rows, c, cm, P, C)
    for p0 in range(BP, P + BP, BP):
        n_next, mu_next, m2_next = _partial_stats(mean_ptr, m2_ptr, count_ptr, p0 + rows, c, cm, P, C)
        total = n_acc + n
        w = n / tl.maximum(total, 1.0)  # 0 for rows past P (n = 0): nothing moves
        delta = mu - mean_acc
        mean_acc += delta * w
        m2_acc += m2 + delta * delta * n_acc * w
        n_acc = total
        n = n_next
        mu = mu_next
        m2 = m2_next
    total = tl.sum(n_acc, 0)
    mean = tl.sum(n_acc * mean_acc, 0) / tl.maximum(total, 1.0)
    d = mean_acc - mean[None, :]
    return mean, tl.sum(m2_acc + n_acc * d * d, 0)


@triton.jit
def _partial_rows(a_ptr, b_ptr, p, c, cm, P, C):
    """Partials ``p`` (rows past ``P``: zeros, nothing read) of channels ``c``, from both arrays."""
    m = (p < P)[:, None] & cm[None, :]
    offsets = p[:, None] * C + c[None, :]
    a = tl.load(a_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
    b = tl.load(b_ptr + offsets, mask=m, other=0.0, cache_modifier=".cg")
    return a, b


@triton.jit
def sum_partials(a_ptr, b_ptr, c, cm, P, C, BP: tl.constexpr, BC: tl.constexpr):
    """Channels ``c``: the ``P`` rows of the ``(P, C)`` float32 partials at ``a_ptr`` and
    ``b_ptr`` added in a fixed order (``BP`` rows at a time, then across the rows; read past the
    SM's cache: other programs wrote them). Each turn issues the next ``BP`` rows' loads before it
    adds the current ones, so two round trips to memory overlap (the last turn's loads lie past
    ``P``: masked, nothing read)."""
    rows = tl.arange(0, BP)
    acc_a = tl.zeros([BP, BC], tl.float32)
    acc_b = tl.zeros([BP, BC], tl.float32)
    a, b = _partial_rows(a_ptr, b_ptr, rows, c, cm, P, C)
    for p0 in range(BP, P + BP, BP):
        next_a, next_b = _partial_rows(a_ptr, b_ptr, p0 + rows, c, cm, P, C)
        acc_a += a
        acc_b += b
        a = next_a
        b = next_b
    return tl.sum(acc_a, 0), tl.sum(acc_b, 0)


@triton.jit
def _finalize(mean, m2, w_ptr, b_ptr, rmean_ptr, rvar_ptr, scale_ptr, shift_ptr, save_mean_ptr,
              save_invstd_ptr, c, cm, M, momentum, eps, HAS_W: tl.constexpr, UPDATE: tl.constexpr):
    """Channels ``c``, from the ``M`` values' ``mean`` and summed squared deviations ``m2``: their
    1/std, ``s`` and ``t``, and the running statistics moved by ``momentum`` (``UPDATE``)."""
    inv_m = 1.0 / M.to(tl.float32)
    invstd = 1.0 / tl.sqrt(m2 * inv_m + eps)
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
def silu_du(x, dy, s, t):
    """``u`` recomputed and SiLU's backward: ``dy silu'(u)``."""
    u = x * s[None, :] + t[None, :]
    sig = tl.sigmoid(u)
    return dy * sig * (1.0 + u * (1.0 - sig))


@triton.jit
def grad_finalize(sdu_ptr, sdux_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, c, cm, P, C, BP: tl.constexpr,
                  BC: tl.constexpr, GRAD: tl.constexpr):
    """Channels ``c``: the ``P`` partial sums added in a fixed order (:func:`sum_partials`) ->
    ``dw = sum du xhat``, ``db = sum du``; and with ``GRAD`` (:mod:`trainfuse.nn.param_grads`)
    the params' grads ``gw``, ``gb`` written (``ASSIGN``) or added to (``ADD``, float32, one
    rounding: what AccumulateGrad's add gives)."""
    sdu, sdux = sum_partials(sdu_ptr, sdux_ptr, c, cm, P, C, BP, BC)
    tl.store(db_ptr + c, sdu, mask=cm)
    tl.store(dw_ptr + c, sdux, mask=cm)
    if GRAD == 2:
        sdu += tl.load(gb_ptr + c, mask=cm, other=0.0)
        sdux += tl.load(gw_ptr + c, mask=cm, other=0.0)
    if GRAD != 0:
        tl.store(gb_ptr + c, sdu, mask=cm)
        tl.store(gw_ptr + c, sdux, mask=cm)


FINALIZE_ROWS = 32  # the partials the last program to arrive reads at a time (two such reads in flight)
launcher = CachedLauncher()  # a launch from raw addresses: an eager step pays little host time a block


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` (N, C, *spatial) as ``(N, C, S)``: a view where the spatial strides merge (contiguous,
    channels_last), else a contiguous copy to read from."""
    return t.reshape(t.shape[0], t.shape[1], -1)


def config(strides: tuple[int, int, int], C: int, reduce: bool = False) -> BNLaunch:
    """The layout's tile (the reductions' with ``reduce``), its channels cut to ``C``'s power of two
    (at least 16) where ``C`` is smaller and its rows grown to keep the tile's size: a 16-channel
    layer in channels_last then wastes no lanes."""
    cfg = CHANNELS_LAST if strides[1] == 1 else CONTIGUOUS
    if reduce and cfg.reduce is not None:
        cfg = cfg.reduce
    channels = min(cfg.channels, max(16, next_power_of_2(C)))
    if channels == cfg.channels:
        return cfg
    return dataclasses.replace(cfg, rows=cfg.rows * cfg.channels // channels, channels=channels)


def flags(cfg: BNLaunch, C: int, S: int, *strides: tuple[int, ...], split: int | None = None) -> dict:
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


def programs(device: torch.device) -> int:
    """Reduction programs to spread over the device (4 SMs' worth under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split(tiles: int, channel_blocks: int, device: torch.device, cfg: BNLaunch) -> tuple[int, int]:
    """``(P, tiles_per_program)``: the tiles split over a channel block's reduction programs."""
    want = max(1, programs(device) * cfg.programs_per_sm // channel_blocks)
    if cfg.partials:
        want = min(want, cfg.partials)
    per = cdiv(tiles, want)
    return cdiv(tiles, per), per


COUNTERS = 256  # arrival counters of a channel block each (4,096 channels in blocks of 16)


def counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` arrival counters at zero, the current stream's (kernels on a stream run in order, and
    the last program of each channel block re-arms its counter). At least three times
    :data:`COUNTERS` (the first third the blocks' arrival counters, the rest the one-launch
    forward's flags: :mod:`trainfuse.nn.bn_persist`), so that the stream's set is made once, not
    grown layer by layer (a CUDA graph keeps the addresses it was captured with)."""
    return stream_workspace(device, None, torch.float32, 0, max(n, 3 * COUNTERS))[1]


def statistics(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
               momentum: float, eps: float, tracked: torch.Tensor | None = None) -> torch.Tensor:
    """The per-channel constants of ``x`` (``(N, C, S)``, :func:`flat`) a BatchNorm applies:
    ``(4, C)`` float32 rows ``s``, ``t``, the mean and ``1/std`` (the module docstring of
    :mod:`trainfuse.nn.bn_silu`); the batch's statistics in one launch, the running ones moved by
    ``momentum``, where ``training``, else the running statistics'. ``tracked``: a module's
    ``num_batches_tracked``, 1 added to it (inside the statistics' launch: no launch of its own)."""
    N, C, S = x.shape
    consts = torch.empty(4, C, device=x.device, dtype=torch.float32)  # scale, shift, mean, invstd
    scale, shift, mean, invstd = consts.unbind(0)
    has_w = weight is not None
    if training:
        rc = config(x.stride(), C, reduce=True)
        rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
        P, per = split(N * rnsb, rcb, x.device, rc)
        partials = torch.empty(3, P, C, device=x.device, dtype=torch.float32)  # mean, m2, count
        update = running_mean is not None
        affine = (weight, bias) if has_w else (consts, consts)  # (unread without HAS_W)
        running = (running_mean, running_var) if update else (consts, consts)  # (unread without UPDATE)
        launcher(bn_stats_kernel, (P * rcb,), x, *partials, counters(x.device, rcb), *affine, *running,
                 scale, shift, mean, invstd, consts if tracked is None else tracked, C, rcb, S, rnsb,
                 N * rnsb, *x.stride(), per, P, N * S, momentum, eps, HAS_W=has_w, UPDATE=update,
                 TRACK=tracked is not None, BP=FINALIZE_ROWS, BR=rc.rows, BC=rc.channels,
                 UNROLL=rc.unroll, num_warps=rc.num_warps, **flags(rc, C, S, x.stride()))
    else:  # the running statistics' constants: a few (C,) operations
        if tracked is not None:
            tracked.add_(1)
        mean.copy_(running_mean)
        torch.rsqrt(running_var.float() + eps, out=invstd)
        scale.copy_(invstd * weight if has_w else invstd)
        shift.copy_((bias - mean * scale) if has_w else -mean * scale)
    return consts


__all__ = ["BNLaunch", "CHANNELS_LAST", "CONTIGUOUS", "COUNTERS", "FINALIZE_ROWS", "bn_stats_kernel",
           "config", "counters", "flags", "flat", "grad_finalize", "launcher", "programs", "silu_du", "split",
           "statistics", "stats_program"]
