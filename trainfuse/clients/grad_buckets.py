"""The flat grads' all-reduce split into buckets launched while the backward still runs.

:meth:`FlatGrads.all_reduce <trainfuse.clients.FlatGrads.all_reduce>` reduces each buffer once the
backward is done, so the GPU computes, then communicates. DDP's reducer overlaps the two: it
launches a bucket's all-reduce as soon as the backward has produced the bucket's grads. A
backward replayed from a CUDA graph runs no hooks, but one that is being captured does: hooks on
the params fire as autograd produces each grad (also under ``torch.autograd.grad``), in the
backward's order. :class:`GradBuckets` gives such a backward (captured or eager) the same overlap:

- the buffers are cut into buckets of about ``cap_bytes``, from the end of each buffer (the last
  params' grads come first in a backward);
- :meth:`GradBuckets.start` hands out a :class:`BucketLaunch` for one backward. Its
  :meth:`~BucketLaunch.ready` takes each param's new grad; once a bucket has all of them, one
  multi-tensor kernel adds them into the bucket's views (or writes them, for grads that were
  None) and the bucket's all-reduce is launched without waiting (``async_op=True``), on NCCL's
  stream, so the rest of the backward runs alongside it;
- :meth:`~BucketLaunch.finish` launches the buckets left (a param the backward gave no grad) and
  makes the current stream wait for every all-reduce. Captured, that is a fork and a join of the
  graph; every rank must launch the same buckets in the same order, which the backward's fixed
  order gives.

Averaging is linear and each bucket is averaged once per backward, so the grads equal what
:meth:`FlatGrads.all_reduce` gives after the backward, up to the order of the additions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainfuse.clients.flat_grads import FlatGrads, reduce_in_place

CAP_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default


class BucketLaunch:
    """One backward's buckets: grads come in by :meth:`ready`, all-reduces go out; see the module."""

    def __init__(self, owner: GradBuckets, positions: dict[int, int], kept: Sequence[torch.Tensor],
                 zero: bool) -> None:
        self._owner = owner
        self._positions = positions  # a leaf's position in the backward's list -> FlatGrads index
        self._kept = kept
        self._zero = zero
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in owner.buckets]
        self._fired = [False] * len(owner.buckets)
        self._works: list = []

    @property
    def positions(self) -> frozenset[int]:
        """The leaves' positions (in the backward's list) whose grads this launch adds in."""
        return frozenset(self._positions)

    def ready(self, position: int, grad: torch.Tensor) -> None:
        """The backward produced the grad of the leaf at ``position``; a bucket that has all of
        its grads now is added in and its all-reduce launched."""
        index = self._positions[position]
        b = self._owner.bucket_of[index]
        self._pending[b].append((self._kept[position], grad))
        if len(self._pending[b]) == len(self._owner.buckets[b][2]):
            self._fire(b)

    def _fire(self, b: int) -> None:
        pending = self._pending[b]
        if pending:
            into, values = map(list, zip(*pending))
            (torch._foreach_copy_ if self._zero else torch._foreach_add_)(into, values)
        self._pending[b] = []
        self._fired[b] = True
        self._works.append(self._owner.reduce(b))

    def finish(self) -> None:
        """Launch the buckets not launched yet, in order, then make the current stream wait for
        every all-reduce (the caller's next kernels read the averaged grads)."""
        for b, fired in enumerate(self._fired):
            if not fired:
                self._fire(b)
        works, self._works = self._works, []
        for work in works:
            if work is not None:
                work.wait()


class GradBuckets:
    """``flat``'s buffers cut into buckets of about ``cap_bytes`` for :class:`BucketLaunch`.

    Args:
        flat: the flat grads (their views are what the backward adds into).
        cap_bytes: a bucket closes once it holds at least this many bytes (a param larger than
            that is a bucket of its own).

    Attributes:
        buckets: per bucket, the buffer's key, its slice (start, stop) of the buffer, and the
            :class:`FlatGrads` indices of its params; in launch order when no param goes unused.
        bucket_of: per FlatGrads index, its bucket.
    """

    def __init__(self, flat: FlatGrads, cap_bytes: int = CAP_BYTES) -> None:
        if cap_bytes <= 0:
            raise ValueError(f"GradBuckets: cap_bytes must be > 0, got {cap_bytes}")
        self.flat = flat
        self.buckets: list[tuple[tuple, tuple[int, int], list[int]]] = []
        self.bucket_of: dict[int, int] = {}
        spans: dict[tuple, list[tuple[int, int, int]]] = {}  # per buffer: (index, start, stop)
        for i, (p, g) in enumerate(zip(flat.params, flat.grads)):
            key = (p.device, p.dtype)
            start = g.storage_offset() - flat.buffers[key].storage_offset()
            spans.setdefault(key, []).append((i, start, start + p.numel()))
        for key, members in spans.items():
            size = flat.buffers[key].element_size()
            current: list[int] = []
            stop = None
            for i, start, end in reversed(members):  # the last params' grads arrive first
                if not current:
                    stop = end
                current.append(i)
                if (stop - start) * size >= cap_bytes:
                    self._close(key, start, stop, current)
                    current = []
            if current:
                self._close(key, members[0][1], stop, current)

    def _close(self, key: tuple, start: int, stop: int, members: list[int]) -> None:
        for i in members:
            self.bucket_of[i] = len(self.buckets)
        self.buckets.append((key, (start, stop), members))

    def start(self, leaves: Sequence[torch.Tensor], kept: Sequence[torch.Tensor], zero: bool
              ) -> BucketLaunch | None:
        """A launch for one backward over ``leaves`` whose grads go into ``kept`` (added, or
        written with ``zero``), or None when it cannot reduce them all: a param of the flat grads
        is not among ``leaves`` (another backward would add to it after its all-reduce), or its
        kept grad is not its view."""
        index = {id(p): i for i, p in enumerate(self.flat.params)}
        positions = {}
        for position, leaf in enumerate(leaves):
            i = index.get(id(leaf))
            if i is None:
                continue
            if kept[position] is not self.flat.grads[i]:
                return None
            positions[position] = i
        if len(positions) != len(self.flat.params):
            return None
        return BucketLaunch(self, positions, kept, zero)

    def reduce(self, b: int):
        """Launch bucket ``b``'s average over the group without waiting: the work, or None (no
        process group, or one rank)."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = self.flat.group
        world = dist.get_world_size(group)
        if world == 1:
            return None
        key, (start, stop), _ = self.buckets[b]
        return reduce_in_place(self.flat.buffers[key][start:stop], group, world, average=True, async_op=True)


__all__ = ["BucketLaunch", "GradBuckets"]
