"""One program's part of BatchNorm + SiLU's backward sums (:func:`grad_sums_program`): what the
grad-sums kernel (:mod:`trainfuse.nn.bn_silu`) and the one-launch backward
(:mod:`trainfuse.nn.bn_persist`) run for a program's tiles, so that both give the same bits."""

import triton
import triton.language as tl

from trainfuse._runtime.reduce import last_to_arrive
from trainfuse.nn import bn_stats
from trainfuse.nn import channel_tiles as tiles


@triton.jit
def du_tile(x_ptr, dy_ptr, dy1_ptr, gp, gN_, gS_, rel, rel_g, q, c, cm, s, t, S, NSB, sN, sS, gN, gC, gS,
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
    du = bn_stats.silu_du(x, tiles.load_tile(grads, m, MASKED), s, t)
    if MASKED:
        du = tl.where(m, du, 0.0)
    return x, du


@triton.jit
def dy_pointers(j, c, dy_ptr, dy1_ptr, gN, gC, gS, hN, hC, hS, SPLIT, rel, BC: tl.constexpr,
                BR: tl.constexpr, PART: tl.constexpr, REL32: tl.constexpr, G_SAME: tl.constexpr):
    """Where channel block ``j``'s ``dy`` lies: its part's pointer and strides and its tile
    offsets (``G_SAME``: laid out as ``x``, ``x``'s offsets ``rel``: fewer registers held across
    a loop)."""
    if PART == 1:
        gp, gN_, gC_, gS_, cg = tiles.block_part(j, c, SPLIT, dy_ptr, dy1_ptr, gN, gC, gS, hN, hC, hS, BC)
    else:  # (PART 2 reads its addresses tile by tile)
        gp, gN_, gC_, gS_, cg = dy_ptr, gN, gC, gS, c
    if G_SAME:
        rel_g = rel
    else:
        rel_g = tiles.tile_offsets(cg, gC_, gS_, BR, REL32)
    return gp, gN_, gS_, rel_g


@triton.jit
def grad_sums_program(x_ptr, dy_ptr, dy1_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, sdu_ptr, sdux_ptr,
                      cnt_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, i, j, c, C, S, NSB, Q, sN, sC, sS, gN, gC, gS,
                      hN, hC, hS, SPLIT, tiles_per_program, P, BP: tl.constexpr, BR: tl.constexpr,
                      BC: tl.constexpr, UNROLL: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr,
                      PART: tl.constexpr, REL32: tl.constexpr, G_SAME: tl.constexpr, GRAD: tl.constexpr):
    """Program ``(i, j)``'s sums of ``du`` and ``du xhat`` over its tiles, stored at ``[i, c]``;
    where it arrives last of block ``j``'s ``P``, their fixed-order total into ``dw`` and ``db``
    (and the params' grads with ``GRAD``: :func:`~trainfuse.nn.bn_stats.grad_finalize`). Returns
    whether it arrived last."""
    cm = c < C
    s = tl.load(scale_ptr + c, mask=cm, other=0.0)
    t = tl.load(shift_ptr + c, mask=cm, other=0.0)
    mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
    invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
    q0 = i * tiles_per_program
    valid = tl.minimum(tiles_per_program, Q - q0)
    rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
    gp, gN_, gS_, rel_g = dy_pointers(j, c, dy_ptr, dy1_ptr, gN, gC, gS, hN, hC, hS, SPLIT, rel, BC, BR, PART,
                                      REL32, G_SAME)
    sdu = tl.zeros([BR, BC], tl.float32)
    sdux = tl.zeros([BR, BC], tl.float32)
    grouped = valid // UNROLL * UNROLL
    for k0 in range(0, grouped, UNROLL):
        for k1 in tl.static_range(UNROLL):  # UNROLL tiles' loads in flight at once
            x, du = du_tile(x_ptr, dy_ptr, dy1_ptr, gp, gN_, gS_, rel, rel_g, q0 + k0 + k1, c, cm, s, t, S,
                            NSB, sN, sS, gN, gC, gS, hN, hC, hS, SPLIT, BR, EVEN_S, MASKED, PART)
            sdu += du
            sdux += du * (x - mean[None, :])
    for k in range(grouped, valid):
        x, du = du_tile(x_ptr, dy_ptr, dy1_ptr, gp, gN_, gS_, rel, rel_g, q0 + k, c, cm, s, t, S, NSB, sN,
                        sS, gN, gC, gS, hN, hC, hS, SPLIT, BR, EVEN_S, MASKED, PART)
        sdu += du
        sdux += du * (x - mean[None, :])
    tl.store(sdu_ptr + i * C + c, tl.sum(sdu, 0), mask=cm)
    tl.store(sdux_ptr + i * C + c, tl.sum(sdux, 0) * invstd, mask=cm)
    tl.debug_barrier()  # every thread's partials are stored before the release below
    last = last_to_arrive(cnt_ptr + j, P)
    if last:
        bn_stats.grad_finalize(sdu_ptr, sdux_ptr, dw_ptr, db_ptr, gw_ptr, gb_ptr, c, cm, P, C, BP, BC,
                               GRAD)
        tl.store(cnt_ptr + j, 0)  # re-armed for the next launch on this stream
    return last


__all__ = ["du_tile", "dy_pointers", "grad_sums_program"]
