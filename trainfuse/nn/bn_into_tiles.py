"""The per-tile and per-program code of the concatenation writer's kernels
(:mod:`trainfuse.nn.bn_silu_into`), shared with their one-launch forms
(:mod:`trainfuse.nn.bn_into_persist`) so that both give the same bits."""

import triton
import triton.language as tl

from trainfuse._runtime.reduce import last_to_arrive
from trainfuse.nn import bn_stats
from trainfuse.nn import channel_tiles as tiles


@triton.jit
def apply_tile(x_ptr, r_ptr, y_ptr, d_ptr, s, t, q, c, cm, S, NSB, sN, sC, sS, rN, rC, rS, yN, yC, yS, dN, dC,
               dS, DF, BR: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, RESIDUAL: tl.constexpr,
               DENSE: tl.constexpr, REL32: tl.constexpr):
    """Tile ``q``'s ``y`` from the constants ``s``, ``t`` of channels ``c``, written as
    :func:`~trainfuse.nn.bn_silu_into.into_apply_kernel` describes."""
    base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
    m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
    x = tiles.load_tile(x_ptr + base + tiles.tile_offsets(c, sC, sS, BR, REL32), m, MASKED)
    u = x * s[None, :] + t[None, :]
    y = u * tl.sigmoid(u)
    if RESIDUAL:  # the block's value as stored, then the shortcut added: r + silu(bn(x))
        rbase, _ = tiles.tile_start(q, NSB, rN, rS, BR)
        r = tiles.load_tile(r_ptr + rbase + tiles.tile_offsets(c, rC, rS, BR, REL32), m, MASKED)
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + r
    ybase, _ = tiles.tile_start(q, NSB, yN, yS, BR)
    tiles.store_tile(y_ptr + ybase + tiles.tile_offsets(c, yC, yS, BR, REL32), y, m, MASKED)
    if DENSE != 0:
        dbase, _ = tiles.tile_start(q, NSB, dN, dS, BR)
        ptrs = d_ptr + dbase + tiles.tile_offsets(c - DF, dC, dS, BR, REL32)
        if DENSE == 1:  # every channel (DF = 0): the slice's mask, none for whole tiles
            tiles.store_tile(ptrs, y, m, MASKED)
        else:
            tl.store(ptrs, y.to(d_ptr.dtype.element_ty), mask=m & (c >= DF)[None, :])



@triton.jit
def grads_tile(x_ptr, g_ptr, e_ptr, q, c, cm, rel, rel_g, rel_e, S, NSB, sN, sS, gN, gS, eN, eS, DF,
           BR: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, ADD: tl.constexpr):
    """Tile ``q``'s ``x``, its grad ``g`` (the slice's, plus the dense tensor's, ``ADD`` as the
    forward's ``DENSE``; float32) and its mask."""
    base, s0 = tiles.tile_start(q, NSB, sN, sS, BR)
    m = tiles.tile_mask(s0, S, cm, BR, EVEN_S)
    x = tiles.load_tile(x_ptr + base + rel, m, MASKED)
    gbase, _ = tiles.tile_start(q, NSB, gN, gS, BR)
    g = tiles.load_tile(g_ptr + gbase + rel_g, m, MASKED)
    if ADD == 1:  # every channel (DF = 0)
        ebase, _ = tiles.tile_start(q, NSB, eN, eS, BR)
        g += tiles.load_tile(e_ptr + ebase + rel_e, m, MASKED)
    elif ADD == 2:
        ebase, _ = tiles.tile_start(q, NSB, eN, eS, BR)
        g += tl.load(e_ptr + ebase + rel_e, mask=m & (c >= DF)[None, :], other=0.0).to(tl.float32)
    return x, g, m


@triton.jit
def du_tile(x_ptr, g_ptr, e_ptr, q, c, cm, rel, rel_g, rel_e, s, t, S, NSB, sN, sS, gN, gS, eN, eS, DF,
        BR: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, ADD: tl.constexpr):
    """Tile ``q``'s ``x`` and ``du = g silu'(u)`` (0 where masked)."""
    x, g, m = grads_tile(x_ptr, g_ptr, e_ptr, q, c, cm, rel, rel_g, rel_e, S, NSB, sN, sS, gN, gS, eN, eS, DF,
                         BR, EVEN_S, MASKED, ADD)
    du = bn_stats.silu_du(x, g, s, t)
    if MASKED:
        du = tl.where(m, du, 0.0)
    return x, du




@triton.jit
def sums_program(x_ptr, g_ptr, e_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr, sdu_ptr, sdux_ptr, cnt_ptr,
                 dw_ptr, db_ptr, gw_ptr, gb_ptr, i, j, c, C, S, NSB, Q, sN, sC, sS, gN, gC, gS, eN, eC, eS,
                 DF, tiles_per_program, P, BP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                 UNROLL: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, ADD: tl.constexpr,
                 REL32: tl.constexpr, GRAD: tl.constexpr):
    """Program ``(i, j)``'s sums of ``du`` and ``du xhat`` over its tiles, added up in a fixed
    order into ``dw`` and ``db`` where it arrives last of block ``j``'s ``P``; returns whether it
    did."""
    cm = c < C
    s = tl.load(scale_ptr + c, mask=cm, other=0.0)
    t = tl.load(shift_ptr + c, mask=cm, other=0.0)
    mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
    invstd = tl.load(invstd_ptr + c, mask=cm, other=0.0)
    q0 = i * tiles_per_program
    valid = tl.minimum(tiles_per_program, Q - q0)
    rel = tiles.tile_offsets(c, sC, sS, BR, REL32)
    rel_g = tiles.tile_offsets(c, gC, gS, BR, REL32)
    rel_e = tiles.tile_offsets(c - DF, eC, eS, BR, REL32)
    sdu = tl.zeros([BR, BC], tl.float32)
    sdux = tl.zeros([BR, BC], tl.float32)
    grouped = valid // UNROLL * UNROLL
    for k0 in range(0, grouped, UNROLL):
        for k1 in tl.static_range(UNROLL):  # UNROLL tiles' loads in flight at once
            x, du = du_tile(x_ptr, g_ptr, e_ptr, q0 + k0 + k1, c, cm, rel, rel_g, rel_e, s, t, S, NSB, sN, sS,
                            gN, gS, eN, eS, DF, BR, EVEN_S, MASKED, ADD)
            sdu += du
            sdux += du * (x - mean[None, :])
    for k in range(grouped, valid):
        x, du = du_tile(x_ptr, g_ptr, e_ptr, q0 + k, c, cm, rel, rel_g, rel_e, s, t, S, NSB, sN, sS, gN, gS,
                        eN, eS, DF, BR, EVEN_S, MASKED, ADD)
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


@triton.jit
def dx_tile(x_ptr, g_ptr, e_ptr, dx_ptr, dr_ptr, q, c, cm, rel, s, t, mean, invstd, dw, db, M, S, NSB, sN, sS,
            gN, gC, gS, eN, eC, eS, DF, dN, dC, dS, fN, fC, fS, TRAINING: tl.constexpr, DX: tl.constexpr,
            DR: tl.constexpr, BR: tl.constexpr, EVEN_S: tl.constexpr, MASKED: tl.constexpr, ADD: tl.constexpr,
            REL32: tl.constexpr):
    """Tile ``q``'s ``dx = s (du - db / M - xhat dw / M)`` (training) or ``s du`` (``DX``) and the
    residual's grad ``dr = g`` (``DR``); ``mean``, ``invstd``, ``dw``, ``db`` read only in
    training."""
    rel_g = tiles.tile_offsets(c, gC, gS, BR, REL32)
    rel_e = tiles.tile_offsets(c - DF, eC, eS, BR, REL32)
    x, g, m = grads_tile(x_ptr, g_ptr, e_ptr, q, c, cm, rel, rel_g, rel_e, S, NSB, sN, sS, gN, gS, eN, eS, DF,
                         BR, EVEN_S, MASKED, ADD)
    if DR:
        fbase, _ = tiles.tile_start(q, NSB, fN, fS, BR)
        tiles.store_tile(dr_ptr + fbase + tiles.tile_offsets(c, fC, fS, BR, REL32), g, m, MASKED)
    if DX:
        du = bn_stats.silu_du(x, g, s, t)
        if TRAINING:
            xhat = (x - mean[None, :]) * invstd[None, :]
            du = du - db[None, :] / M - xhat * (dw[None, :] / M)
        dbase, _ = tiles.tile_start(q, NSB, dN, dS, BR)
        dx = du * s[None, :]
        tiles.store_tile(dx_ptr + dbase + tiles.tile_offsets(c, dC, dS, BR, REL32), dx, m, MASKED)


__all__ = ["apply_tile", "du_tile", "dx_tile", "grads_tile", "sums_program"]
