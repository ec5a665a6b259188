"""The loss items of graph replays, read back without a host sync, and exact per-epoch means."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# loss-item copies in flight at once: the host runs at most this many iterations ahead of the GPU
RING = 4


class LossReadout:
    """Loss items read back without a host sync, and exact per-epoch means.

    Args:
        names: the loss items' names, in the order of the items vector.
        device: the CUDA device the items are computed on.
    """

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        self.names = tuple(names)
        self._slots = torch.zeros((RING, len(self.names)), dtype=torch.float32, pin_memory=True)
        self._events: list[torch.cuda.Event | None] = [None] * RING
        self._next = 0
        self._sum = torch.zeros(len(self.names), dtype=torch.float32, device=device)
        self._count = 0

    def start_epoch(self) -> None:
        """Restart the per-epoch sums (one fill on the GPU)."""
        self._sum.zero_()
        self._count = 0

    def push(self, items: torch.Tensor) -> dict[str, torch.Tensor]:
        """Add one iteration's ``items`` (a CUDA vector) to the epoch's sums and queue their copy.

        Returns:
            The newest items whose copy has finished, as 0-d CPU tensors by name: this call's
            when the GPU has caught up, else a few iterations older. It waits for the GPU only
            when no copy has finished yet, or ``RING`` copies are in flight.
        """
        self._sum += items
        self._count += 1
        k = self._next
        pending = self._events[k]
        if pending is not None:
            pending.synchronize()  # the ring is full: the oldest copy must land before its slot is reused
        self._slots[k].copy_(items, non_blocking=True)
        event = self._events[k] = torch.cuda.Event()
        event.record()
        self._next = (k + 1) % RING
        newest = None
        for back in range(RING):
            j = (k - back) % RING
            e = self._events[j]
            if e is not None and e.query():
                newest = j
                break
        if newest is None:  # nothing has landed yet (the first iterations): wait for the oldest
            newest = next(j for j in ((k + 1 + i) % RING for i in range(RING)) if self._events[j] is not None)
            self._events[newest].synchronize()
        return dict(zip(self.names, self._slots[newest].clone().unbind()))

    def epoch_means(self) -> dict[str, torch.Tensor] | None:
        """The exact mean of every item over this epoch's iterations (one host sync), or None
        before the epoch's first iteration."""
        if self._count == 0:
            return None
        return dict(zip(self.names, (self._sum / self._count).cpu().unbind()))


__all__ = ["RING", "LossReadout"]
