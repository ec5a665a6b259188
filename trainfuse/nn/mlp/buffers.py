"""The tensors FusedMLP makes in a call (inner outputs, saved derivatives, input grads, param grads),
carved as views from one allocation per kind: a small MLP's step is host-bound, and each
``torch.empty`` is a trip through the caching allocator."""

from __future__ import annotations

import math

import torch


def carve(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Row-major tensors of ``shapes`` (1-d or 2-d) carved from one allocation, each starting
    128-byte aligned (TMA needs 16): one trip through the caching allocator instead of one per
    tensor (a CUDA ``torch.empty`` costs several microseconds of host time, a view about one)."""
    if not shapes:
        return []
    align = 128 // dtype.itemsize
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) // align) * align
    buf = torch.empty(total, dtype=dtype, device=device)
    return [buf.as_strided(shape, (shape[1], 1) if len(shape) == 2 else (1,), off)
            for shape, off in zip(shapes, offsets)]


def alternating(shapes: list[tuple[int, int]], dtype: torch.dtype,
                device: torch.device) -> list[torch.Tensor]:
    """Row-major 2-d tensors of ``shapes``, in the order they are written, each read only until
    the one after next is written (one stream's input grads: the input grad of layer ``i`` is read
    by layer ``i``'s weight and input grads, which run before layer ``i - 1`` writes): they take
    turns in two halves of one allocation, so the backward holds two such tensors at a time, as
    many as if each had its own allocation, freed once the next was made."""
    if not shapes:
        return []
    align = 128 // dtype.itemsize
    even = max(math.prod(s) for s in shapes[0::2])
    start = -(-even // align) * align
    odd = max((math.prod(s) for s in shapes[1::2]), default=0)
    buf = torch.empty(start + odd, dtype=dtype, device=device)
    return [buf.as_strided(s, (s[1], 1), 0 if j % 2 == 0 else start) for j, s in enumerate(shapes)]


def param_grads(weights, bias_dtypes, need_w, need_b, device) -> tuple[list, list]:
    """Empty weight grads (also where only the bias grad is wanted: the kernel writes both) and
    bias grads, carved from one allocation per dtype; a non-contiguous weight gets a grad of its
    own layout (autograd would copy a contiguous one)."""
    n = len(weights)
    gw, gb = [None] * n, [None] * n
    wanted: dict[torch.dtype, list[tuple[list, int, tuple]]] = {}
    for i, w in enumerate(weights):
        if not (need_w[i] or need_b[i]):
            continue
        if w.is_contiguous():
            wanted.setdefault(w.dtype, []).append((gw, i, tuple(w.shape)))
        else:
            gw[i] = torch.empty_like(w)
        if need_b[i]:
            wanted.setdefault(bias_dtypes[i], []).append((gb, i, (w.shape[0],)))
    for dtype, items in wanted.items():
        for (dest, i, _), t in zip(items, carve([shape for *_, shape in items], dtype, device)):
            dest[i] = t
    return gw, gb


__all__ = ["alternating", "carve", "param_grads"]
