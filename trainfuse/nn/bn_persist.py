"""BatchNorm + SiLU's training forward in one launch: the statistics' programs wait for their
channel block's constants and apply them to the tiles they have just read (``TRAINFUSE_BN_PERSIST=1``).

The two-launch forward (:mod:`trainfuse.nn.bn_silu`) reads ``x`` for the statistics, ends the
kernel, and launches a second grid that reads ``x`` again to write ``y``. On a YOLO model most
BatchNorms are small (a 20 x 20 map at batch 16 is 6,400 positions): each launch is a few
microseconds of work between a ramp and a tail, and the second read comes from DRAM although the
map was in L2 a moment before. Here the statistics' grid is the whole launch: each program folds
its tiles into its partials (:func:`~trainfuse.nn.bn_stats.stats_program`, the same code and bits
as the statistics kernel), the last of a channel block merges them and writes the constants, then
releases a flag the block's other programs spin on; every program then writes ``y`` for its own
tiles, read again while they are in cache.

A program spins only for programs of its own launch, so the launch is made only where the GPU
holds all of its programs at once (:func:`resident`: the compiled kernel's registers and shared
memory against an SM's), else the two-launch forward runs. Under the Triton interpreter, which
runs programs one after another, the same kernel runs as two launches, statistics then apply
(``BARRIER`` off), so CI checks everything but the flag. The same bits as the two-launch forward:
the same partials, merge and constants, and ``y`` elementwise from them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from trainfuse._runtime import compat
from trainfuse._runtime.backend import interpreting
from trainfuse._runtime.launch import cdiv
from trainfuse.nn import bn_grad_sums, bn_stats
from trainfuse.nn import channel_tiles as tiles


def enabled() -> bool:
    """Whether ``TRAINFUSE_BN_PERSIST=1`` asks for the one-launch kernels, outside a process group
    of several ranks (a collective holding SMs while it waits for another rank could keep a
    waiting program off the GPU)."""
    if os.environ.get("TRAINFUSE_BN_PERSIST", "0") != "1":
        return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


@triton.jit(do_not_specialize=["CB", "NSB", "Q", "tiles_per_program", "P", "M", "SPLIT", "yP"])
def bn_stats_apply_kernel(x_ptr, y_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, flag_ptr, w_ptr, b_ptr,
                          rmean_ptr, rvar_ptr, scale_ptr, shift_ptr, save_mean_ptr, save_invstd_ptr,
                          tracked_ptr, C, CB, S, NSB, Q, sN, sC, sS, yN, yC, yS, SPLIT, yP, tiles_per_program,
                          P, M, momentum, eps,
                          HAS_W: tl.constexpr, UPDATE: tl.constexpr, TRACK: tl.constexpr, BP: tl.constexpr,
                          BR: tl.constexpr, BC: tl.constexpr, UNROLL: tl.constexpr, EVEN_S: tl.constexpr,
                          MASKED: tl.constexpr, REL32: tl.constexpr, PART: tl.constexpr, STATS: tl.constexpr,
                          APPLY: tl.constexpr, BARRIER: tl.constexpr):
    """Program ``(i, j)`` (``i * CB + j``): with ``STATS``, :func:`~trainfuse.nn.bn_stats.
    bn_stats_kernel`'s work; with ``APPLY``, ``y = silu(x s + t)`` over the same tiles (channels
    from ``SPLIT`` on into a second part of ``y``, ``yP`` elements on: ``PART`` as in the apply
    kernel). ``BARRIER`` (both on): between the two, the block's last program releases
    ``flag[j]`` once the constants are written and the others wait for it; the last to leave
    re-arms ``flag[j]`` and the departure count ``flag[CB + j]``."""
    i, j, c = tiles.program(CB, BC)
    cm = c < C
    if STATS:
        last = bn_stats.stats_program(x_ptr, mean_ptr, m2_ptr, count_ptr, cnt_ptr, w_ptr, b_ptr, rmean_ptr,
                                      rvar_ptr, scale_ptr, shift_ptr, save_mean_ptr, save_invstd_ptr,
                                      tracked_ptr, i, j, c, C, S, NSB, Q, sN, sC, sS, tiles_per_program, P,
                                      M, momentum, eps, HAS_W, UPDATE, TRACK, BP, BR, BC, UNROLL, EVEN_S,
                                      MASKED, REL32)
        if BARRIER:
            wait_for_block(flag_ptr, j, last)
    if APPLY:
        # read past the SM's cache: the block's last program wrote them in this launch
        s = tl.load(scale_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        t = tl.load(shift_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        q0 = i * tiles_per_program
        valid = tl.minimum(tiles_per_program, Q - q0)
        rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
        for k in range(valid):
            q = q0 + k
            base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
            m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
            x = tiles.load_tile(x_ptr + base + rel, m, MASKED)
            u = x * s[None, :] + t[None, :]
            out = tiles.tile_addresses(y_ptr, y_ptr + yP, q, j, c, NSB, yN, yC, yS, yN, yC, yS, SPLIT, BR, BC,
                                       PART, REL32)
            tiles.store_tile(out, u * tl.sigmoid(u), m, MASKED)
        if BARRIER:
            leave_block(flag_ptr, j, CB, P)


@triton.jit(do_not_specialize=["CB", "NSB", "Q", "tiles_per_program", "P", "M", "SPLIT"])
def bn_grad_dx_kernel(x_ptr, dy_ptr, dy1_ptr, dx_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, sdu_ptr,
                      sdux_ptr, cnt_ptr, flag_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, C, CB, S, NSB, Q, sN, sC,
                      sS, gN, gC, gS, hN, hC, hS, SPLIT, tiles_per_program, P, M, BP: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr, UNROLL: tl.constexpr, EVEN_S: tl.constexpr,
                      MASKED: tl.constexpr, PART: tl.constexpr, REL32: tl.constexpr, G_SAME: tl.constexpr,
                      GRAD: tl.constexpr, SUMS: tl.constexpr, DX: tl.constexpr, BARRIER: tl.constexpr):
    """Program ``(i, j)`` (``i * CB + j``): with ``SUMS``, the grad-sums kernel's work
    (:func:`~trainfuse.nn.bn_grad_sums.grad_sums_program`); with ``DX``, ``dx = s (du - db / M -
    xhat dw / M)`` over the same tiles (``dx`` laid out as ``x``; ``dy`` in two parts as the sums
    read it). ``BARRIER``: the block's flag between the two, as in :func:`bn_stats_apply_kernel`."""
    i, j, c = tiles.program(CB, BC)
    cm = c < C
    if SUMS:
        last = bn_grad_sums.grad_sums_program(x_ptr, dy_ptr, dy1_ptr, scale_ptr, shift_ptr, mean_ptr,
                                              invstd_ptr, sdu_ptr, sdux_ptr, cnt_ptr, dw_ptr, db_ptr, gw_ptr,
                                              gb_ptr, i, j, c, C, S, NSB, Q, sN, sC, sS, gN, gC, gS, hN, hC,
                                              hS, SPLIT, tiles_per_program, P, BP, BR, BC, UNROLL, EVEN_S,
                                              MASKED, PART, REL32, G_SAME, GRAD)
        if BARRIER:
            wait_for_block(flag_ptr, j, last)
    if DX:
        s = tl.load(scale_ptr + c, mask=cm, other=0.0)
        t = tl.load(shift_ptr + c, mask=cm, other=0.0)
        mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
        invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
        # read past the SM's cache: the block's last program wrote them in this launch
        dw = tl.load(dw_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        db = tl.load(db_ptr + c, mask=cm, other=0.0, cache_modifier=".cg")
        q0 = i * tiles_per_program
        valid = tl.minimum(tiles_per_program, Q - q0)
        rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
        gp, gN_, gS_, rel_g = bn_grad_sums.dy_pointers(j, c, dy_ptr, dy1_ptr, gN, gC, gS, hN, hC, hS, SPLIT,
                                                       rel, BC, BR, PART, REL32, G_SAME)
        for k in range(valid):
            q = q0 + k
            x, du = bn_grad_sums.du_tile(x_ptr, dy_ptr, dy1_ptr, gp, gN_, gS_, rel, rel_g, q, c, cm, s, t, S,
                                         NSB, sN, sS, gN, gC, gS, hN, hC, hS, SPLIT, BR, EVEN_S, MASKED, PART)
            base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
            m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
            xhat = (x - mean[None, :]) * invstd[None, :]
            du = du - db[None, :] / M - xhat * (dw[None, :] / M)
            tiles.store_tile(dx_ptr + base + rel, du * s[None, :], m, MASKED)
        if BARRIER:
            leave_block(flag_ptr, j, CB, P)


@triton.jit
def wait_for_block(flag_ptr, j, last):
    """The block's last program (``last``: its totals written) releases ``flag[j]``; the others
    wait for it."""
    if last:
        tl.debug_barrier()  # every thread's stores are made before the release
        tl.atomic_xchg(flag_ptr + j, 1, sem="release")
    else:
        while tl.atomic_add(flag_ptr + j, 0, sem="acquire") == 0:
            pass


@triton.jit
def leave_block(flag_ptr, j, CB, P):
    """Count this program out of block ``j``; the last of its ``P`` re-arms the flag and the count."""
    if tl.atomic_add(flag_ptr + CB + j, 1, sem="relaxed") == P - 1:  # every program is past the flag
        tl.store(flag_ptr + j, 0)
        tl.store(flag_ptr + CB + j, 0)


# ---- where one launch fits -------------------------------------------------------------------------
@functools.cache
def _sm_limits(index: int) -> tuple[int, int, int, int]:
    """Device ``index``'s SMs, and an SM's registers, threads and shared memory."""
    props = torch.cuda.get_device_properties(index)
    return (props.multi_processor_count, getattr(props, "regs_per_multiprocessor", 65536),
            getattr(props, "max_threads_per_multi_processor", 2048),
            getattr(props, "shared_memory_per_multiprocessor", 0))


def resident(regs: int, shared: int, num_warps: int, index: int) -> int:
    """Programs of a kernel using ``regs`` registers a thread and ``shared`` bytes a program that
    one SM of device ``index`` holds at once: registers allocated 256 a warp at a time, 1 KB of
    shared memory reserved a program, at most 32 programs an SM."""
    _, sm_regs, sm_threads, sm_shared = _sm_limits(index)
    warp_regs = cdiv(max(regs, 1) * 32, 256) * 256
    per_sm = min(sm_regs // (warp_regs * num_warps), sm_threads // (32 * num_warps), 32)
    if sm_shared:
        per_sm = min(per_sm, sm_shared // (shared + 1024))
    return per_sm


_capacity: dict[tuple, int | None] = {}


def per_sm(kernel, args: tuple, constexprs: dict, num_warps: int, device: torch.device) -> int | None:
    """How many programs of this specialization of ``kernel`` one SM of ``device`` holds at once
    (compiled without a launch), or None where the compiled kernel says nothing of its registers."""
    # what Triton specializes on: tensors' dtypes and 16-byte alignment, ints equal to 1 or divisible by 16
    key = (kernel, device.index, num_warps, tuple(sorted(constexprs.items())),
           tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (a == 1, a % 16 == 0) if isinstance(a, int) else type(a) for a in args))
    if key not in _capacity:
        used = compat.compiled_resources(kernel.warmup(*args, grid=(1,), num_warps=num_warps, **constexprs))
        index = device.index if device.index is not None else torch.cuda.current_device()
        _capacity[key] = None if used is None else resident(*used, num_warps, index)
    return _capacity[key]


def flags(device: torch.device) -> torch.Tensor:
    """The current stream's flags and departure counts (two per channel block, at zero), past
    the blocks' arrival counters."""
    return bn_stats.counters(device, 3 * bn_stats.COUNTERS)[bn_stats.COUNTERS:]


def launch(kernel, cfg: bn_stats.BNLaunch, tiles: int, rcb: int, args_for, constexprs: dict,
           device: torch.device, phases: tuple[str, str]) -> bool:
    """Launch ``kernel`` over ``tiles`` tiles of each of ``rcb`` channel blocks, with
    ``args_for(P, per)`` its arguments for ``P`` programs a block of ``per`` tiles each
    (:func:`~trainfuse.nn.bn_stats.split`): under the interpreter as two launches (``phases``'
    first constexpr on, then the second); on a GPU once with ``BARRIER`` where the GPU holds all
    of its programs at once. False, nothing launched, where it would not (an SM holds fewer of
    the compiled kernel than ``cfg``'s programs per SM: fewer programs would read the map slower
    than the two launches; or more channel blocks than that), or where the compiled kernel says
    nothing of its registers."""
    first, second = phases
    P, per = bn_stats.split(tiles, rcb, device, cfg)
    if interpreting():  # programs run one after another: the two phases as two launches
        args = args_for(P, per)
        bn_stats.launcher(kernel, (P * rcb,), *args, **constexprs, **{first: True, second: False},
                          BARRIER=False, num_warps=cfg.num_warps)
        bn_stats.launcher(kernel, (P * rcb,), *args, **constexprs, **{first: False, second: True},
                          BARRIER=False, num_warps=cfg.num_warps)
        return True
    constexprs = {**constexprs, first: True, second: True, "BARRIER": True}
    args = args_for(P, per)
    fits = per_sm(kernel, args, constexprs, cfg.num_warps, device)
    if not fits or fits < cfg.programs_per_sm or P * rcb > fits * bn_stats.programs(device):
        return False
    bn_stats.launcher(kernel, (P * rcb,), *args, **constexprs, num_warps=cfg.num_warps)
    return True


def forward(x: torch.Tensor, y: torch.Tensor, ys: tuple[int, int, int], split: int, part: int,
            weight: torch.Tensor | None, bias: torch.Tensor | None, running_mean: torch.Tensor | None,
            running_var: torch.Tensor | None, momentum: float, eps: float,
            tracked: torch.Tensor | None) -> torch.Tensor | None:
    """The training forward of ``x`` (``(N, C, S)``) into ``y`` (strides ``ys``; channels from
    ``split`` on ``part`` elements further, as the apply kernel takes them) in one launch; returns
    the ``(4, C)`` constants (:func:`~trainfuse.nn.bn_stats.statistics`'), or None, nothing done,
    where the launch's programs would not all fit on the GPU at once."""
    N, C, S = x.shape
    rc = bn_stats.config(x.stride(), C, reduce=True)
    rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
    if rcb > bn_stats.COUNTERS:  # the flags would lie on the arrival counters
        return None
    consts = torch.empty(4, C, device=x.device, dtype=torch.float32)
    scale, shift, mean, invstd = consts.unbind(0)
    has_w, update = weight is not None, running_mean is not None
    affine = (weight, bias) if has_w else (consts, consts)
    running = (running_mean, running_var) if update else (consts, consts)

    def args_for(P: int, per: int) -> tuple:
        partials = torch.empty(3, P, C, device=x.device, dtype=torch.float32)  # mean, m2, count
        return (x, y, *partials, bn_stats.counters(x.device, rcb), flags(x.device), *affine, *running, scale,
                shift, mean, invstd, consts if tracked is None else tracked, C, rcb, S, rnsb, N * rnsb,
                *x.stride(), *ys, split, part, per, P, N * S, momentum, eps)

    constexprs = dict(HAS_W=has_w, UPDATE=update, TRACK=tracked is not None, BP=bn_stats.FINALIZE_ROWS,
                      BR=rc.rows, BC=rc.channels, UNROLL=rc.unroll,
                      **bn_stats.flags(rc, C, S, x.stride(), ys, split=split))
    launched = launch(bn_stats_apply_kernel, rc, N * rnsb, rcb, args_for, constexprs, x.device,
                      ("STATS", "APPLY"))
    return consts if launched else None


def backward(x: torch.Tensor, dy: torch.Tensor, dy1: torch.Tensor, split: int, dx: torch.Tensor,
             consts: torch.Tensor, sums: torch.Tensor, grads: tuple, direct: int) -> bool:
    """The training backward of ``x`` (``(N, C, S)``) from ``dy`` (channels from ``split`` on in
    ``dy1``) in one launch: ``dw``, ``db`` into ``sums`` (and the params' ``grads`` with
    ``direct``, as the grad-sums kernel), ``dx`` (laid out as ``x``). False, nothing done, where
    the launch's programs would not all fit on the GPU at once."""
    N, C, S = x.shape
    rc = bn_stats.config(x.stride(), C, reduce=True)
    rcb, rnsb = cdiv(C, rc.channels), cdiv(S, rc.rows)
    if rcb > bn_stats.COUNTERS or dx.stride() != x.stride():
        return False
    scale, shift, mean, invstd = consts.unbind(0)

    def args_for(P: int, per: int) -> tuple:
        partials = torch.empty(2, P, C, device=x.device, dtype=torch.float32)  # sum du, sum du xhat
        return (x, dy, dy1, dx, scale, shift, mean, invstd, *partials, bn_stats.counters(x.device, rcb),
                flags(x.device), *sums, *grads, C, rcb, S, rnsb, N * rnsb, *x.stride(), *dy.stride(),
                *dy1.stride(), split, per, P, N * S)

    constexprs = dict(BP=bn_stats.FINALIZE_ROWS, BR=rc.rows, BC=rc.channels, UNROLL=rc.unroll,
                      G_SAME=split >= C and dy.stride() == x.stride(), GRAD=direct,
                      **bn_stats.flags(rc, C, S, x.stride(), dy.stride(), dy1.stride(), split=split))
    return launch(bn_grad_dx_kernel, rc, N * rnsb, rcb, args_for, constexprs, x.device, ("SUMS", "DX"))


__all__ = ["backward", "bn_grad_dx_kernel", "bn_stats_apply_kernel", "enabled", "flags", "forward", "launch",
           "leave_block", "per_sm", "resident", "wait_for_block"]
