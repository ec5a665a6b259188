"""Tiles of a ``(N, C, S)`` activation for the channel-wise kernels (``bn_silu``): a tile is
``BR`` positions of one image by ``BC`` channels. Its element offsets from its first element are
made once per program (:func:`tile_offsets`), and each tile adds one scalar (:func:`tile_start`).
Masks only where a tile or a channel block runs past the tensor; a tensor may come in two parts
split along the channels (a C2f block's halves), read where the split falls."""

import triton
import triton.language as tl


@triton.jit
def program(CB, BC: tl.constexpr):
    """This program's ``(i, j, c)``: its index among the tiles (or runs of tiles), its block of
    channels and their indices, from a 1-d grid of ``i * CB + j`` (the cached launcher's grids are
    1-d)."""
    pid = tl.program_id(0)
    i = pid // CB
    j = pid - i * CB
    return i, j, j * BC + tl.arange(0, BC)


@triton.jit
def tile_offsets(c, sC, sS, BR: tl.constexpr, REL32: tl.constexpr):
    """A tile's element offsets from its first element (positions by channels ``c``), made once
    per program: each tile then adds one scalar. ``REL32``: they fit 32 bits (the host checks)."""
    r = tl.arange(0, BR)
    if REL32:
        rel = r[:, None] * sS + c[None, :] * sC
    else:
        rel = r.to(tl.int64)[:, None] * sS + c.to(tl.int64)[None, :] * sC
    return rel


@triton.jit
def tile_start(q, NSB, sN, sS, BR: tl.constexpr):
    """Tile ``q`` (image ``q // NSB``, its position block ``q % NSB``): the offset of its first
    element and its first position."""
    n = q // NSB
    s0 = (q - n * NSB) * BR
    return n.to(tl.int64) * sN + s0.to(tl.int64) * sS, s0


@triton.jit
def tile_mask(s0, S, cm, BR: tl.constexpr, EVEN_S: tl.constexpr):
    """The tile's valid elements: its positions below ``S`` (all of them with ``EVEN_S``: the
    positions fill whole tiles) and the channels below ``C`` (``cm``)."""
    if EVEN_S:
        m = cm[None, :]
    else:
        m = ((s0 + tl.arange(0, BR)) < S)[:, None] & cm[None, :]
    return m


@triton.jit
def load_tile(ptrs, m, MASKED: tl.constexpr):
    """The tile's values as float32; without ``MASKED`` (whole tiles of whole channel blocks)
    every element is loaded as is, so the loads vectorize with no predicate."""
    if MASKED:
        x = tl.load(ptrs, mask=m, other=0.0)
    else:
        x = tl.load(ptrs)
    return x.to(tl.float32)


@triton.jit
def store_tile(ptrs, v, m, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=m)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty))


@triton.jit
def block_part(j, c, SPLIT, ptr0, ptr1, N0, C0, S0, N1, C1, S1, BC: tl.constexpr):
    """Where channel block ``j`` of a two-part tensor lies, the block wholly in one part (the
    split a multiple of the block): the first part (``ptr0``, strides ``N0, C0, S0``) below
    channel ``SPLIT``, the second (``ptr1``, its channels from 0) from it on. Returns the part's
    pointer and strides and ``c`` as its channels."""
    second = j * BC >= SPLIT
    return (tl.where(second, ptr1, ptr0), tl.where(second, N1, N0), tl.where(second, C1, C0),
            tl.where(second, S1, S0), c - second.to(tl.int32) * SPLIT)


@triton.jit
def split_addresses(ptr0, ptr1, q, c, NSB, N0, C0, S0, N1, C1, S1, SPLIT, BR: tl.constexpr):
    """Tile ``q``'s addresses by channels ``c`` of a two-part tensor split inside the channel
    block: channels from ``SPLIT`` on in the second part, as its channels from 0."""
    n = q // NSB
    s = ((q - n * NSB) * BR + tl.arange(0, BR)).to(tl.int64)
    first = n.to(tl.int64) * N0 + s[:, None] * S0 + c.to(tl.int64)[None, :] * C0
    second = n.to(tl.int64) * N1 + s[:, None] * S1 + (c - SPLIT).to(tl.int64)[None, :] * C1
    return tl.where((c >= SPLIT)[None, :], ptr1 + second, ptr0 + first)


@triton.jit
def tile_addresses(ptr0, ptr1, q, j, c, NSB, N0, C0, S0, N1, C1, S1, SPLIT, BR: tl.constexpr,
                   BC: tl.constexpr, PART: tl.constexpr, REL32: tl.constexpr):
    """Tile ``q``'s addresses by channel block ``j`` (channels ``c``) of a tensor in one part
    (``PART`` 0), or in two split at a multiple of the block (1) or anywhere (2)."""
    if PART == 2:
        ptrs = split_addresses(ptr0, ptr1, q, c, NSB, N0, C0, S0, N1, C1, S1, SPLIT, BR)
    else:
        if PART == 1:
            p, pN, pC, pS, cp = block_part(j, c, SPLIT, ptr0, ptr1, N0, C0, S0, N1, C1, S1, BC)
        else:
            p, pN, pC, pS, cp = ptr0, N0, C0, S0, c
        base, _ = tile_start(q, NSB, pN, pS, BR)
        ptrs = p + base + tile_offsets(cp, pC, pS, BR, REL32)
    return ptrs


__all__ = ["block_part", "load_tile", "program", "split_addresses", "store_tile", "tile_addresses",
           "tile_mask", "tile_offsets", "tile_start"]
