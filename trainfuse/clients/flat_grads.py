"""Gradients kept as views of one flat buffer per (device, dtype), all-reduced in one collective.

DDP's reducer registers a hook on every param, fills buckets as the backward produces grads and
launches an all-reduce per bucket, on every backward (ultralytics does not use ``no_sync``, so it
all-reduces every micro-batch). A step replayed from a CUDA graph has no hooks to run, and its
grads accumulate in place across micro-batches: all that is left to do is to reduce the
accumulated grads once per optimizer step. :class:`FlatGrads` gives every param a ``.grad`` that
is a view of one buffer, with the param's own strides (channels_last weights keep their layout),
so that reduction is one ``all_reduce`` launched right after the last replay.

DDP divides each bucket by the world size and sums; :meth:`FlatGrads.all_reduce` with
``average=True`` does the same (NCCL's average), so both clients get DDP's grads up to the order
in which micro-batches add (DDP reduces each one; here they add first). ``average=False`` sums.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def _dense(p: torch.Tensor) -> bool:
    """Whether ``p``'s elements fill a span of exactly ``numel`` without overlap (contiguous,
    channels_last, any permutation), so a slice of a buffer can take its strides."""
    if p.numel() == 0:
        return True
    order = sorted((s, n) for s, n in zip(p.stride(), p.shape) if n != 1)
    expected = 1
    for stride, size in order:
        if stride != expected:
            return False
        expected *= size
    return True


def reduce_in_place(tensor: torch.Tensor, group: dist.ProcessGroup | None, world: int, average: bool,
                    async_op: bool = False):
    """Sum ``tensor`` over ``group``'s ``world`` ranks in place; with ``average``, divide by the
    world size first, as DDP does (NCCL divides inside the collective: no pass of our own). The
    work with ``async_op``, else None."""
    if average and dist.get_backend(group) == "nccl":
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    if average:
        tensor.div_(world)
    return dist.all_reduce(tensor, group=group, async_op=async_op)


class FlatGrads:
    """One zeroed buffer per (device, dtype) of ``params`` and a ``.grad`` view of it per param.

    Args:
        params: the params whose grads are reduced (each once; frozen ones are skipped).
        group: the process group of the reduction (None: the default group).

    Attributes:
        buffers: the flat buffers, one per (device, dtype), in the order the params first use them.
        grads: one view per param, in the order of ``params``; :meth:`attach` makes them the
            params' ``.grad``.
        copied: how many grads the last :meth:`attach` copied in from other tensors.
    """

    def __init__(self, params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
        seen: set[int] = set()
        self.params = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.group = group
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        offsets = []
        for p in self.params:
            key = (p.device, p.dtype)
            offsets.append((key, sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + p.numel()
        self.copied = 0
        self.buffers = {key: torch.zeros(n, device=key[0], dtype=key[1]) for key, n in sizes.items()}
        self.grads = []
        for p, (key, offset) in zip(self.params, offsets):
            flat = self.buffers[key][offset:offset + p.numel()]
            self.grads.append(flat.as_strided(p.shape, p.stride()) if _dense(p) else flat.view(p.shape))

    def attach(self) -> FlatGrads:
        """Make each view its param's ``.grad`` again: a grad another tensor holds is copied into
        it (:attr:`copied` counts them), a None grad (``zero_grad(set_to_none=True)``) becomes zeros."""
        emptied = []
        self.copied = 0
        for p, g in zip(self.params, self.grads):
            if p.grad is g:
                continue
            if p.grad is None:
                emptied.append(g)
            else:
                g.copy_(p.grad)
                self.copied += 1
            p.grad = g
        if emptied:
            torch._foreach_zero_(emptied)
        return self

    def attached(self) -> bool:
        """Whether every param's ``.grad`` is still its view (a ``zero_grad(set_to_none=True)``
        or a backward into a None grad replaces them)."""
        return all(p.grad is g for p, g in zip(self.params, self.grads))

    def all_reduce(self, average: bool = False) -> None:
        """Sum every buffer over the group's ranks in place, one ``all_reduce`` per buffer (one
        for float32 grads on one device); with ``average``, divide by the world size first, as
        DDP does. Nothing happens outside a process group or with one rank.

        Raises:
            RuntimeError: a param's ``.grad`` is no longer its view (the reduction would miss it).
        """
        if not dist.is_available() or not dist.is_initialized():
            return
        world = dist.get_world_size(self.group)
        if world == 1:
            return
        if not self.attached():
            moved = [i for i, (p, g) in enumerate(zip(self.params, self.grads)) if p.grad is not g]
            raise RuntimeError(f"FlatGrads.all_reduce: the grads of params {moved[:8]} are no longer views "
                               "of the flat buffers (set to None or replaced); call attach() after zero_grad")
        for buffer in self.buffers.values():
            reduce_in_place(buffer, self.group, world, average)

    def detach(self) -> None:
        """Set the params' grads that are still views back to None (the buffers go with this object)."""
        for p, g in zip(self.params, self.grads):
            if p.grad is g:
                p.grad = None


__all__ = ["FlatGrads", "reduce_in_place"]
