"""Under DDP, the gradient all-reduce as one collective of one flat buffer per optimizer step: the
change both clients make (Lightning's ``FusedTraining``, ultralytics' ``FusedDetectionTrainer``).

DDP registers a hook on every param and all-reduces a bucket whenever its grads are ready, on the
host's time; a backward replayed from a CUDA graph runs no hook at all. So DDP's reducer stays
idle, every param's grad becomes a view of one flat buffer (:class:`~trainfuse.clients.FlatGrads`;
the graphs accumulate into those views), and once the step's grads are complete one all-reduce
averages the buffer as DDP does (divide by the world size, sum). How DDP's reducer is kept idle
and when the grads are complete is each client's part (its subclass).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from typing_extensions import override

from trainfuse.clients.change import Change, RunT
from trainfuse.clients.flat_grads import FlatGrads
from trainfuse.clients.report import ON, Row


class FlatAllReduce(Change[RunT]):
    """One flat gradient buffer, all-reduced once per optimizer step (module docstring).

    Attributes:
        flat: the grads' buffer and views while the change is applied, else None.
    """

    kind = "ddp"

    def __init__(self) -> None:
        self.flat: FlatGrads | None = None

    @override
    def name(self, run: RunT) -> str:
        return "all-reduce"

    def make_flat(self, params: Iterable[torch.Tensor]) -> FlatGrads:
        """Give every trainable param in ``params`` its grad as a view of one flat buffer."""
        self.flat = FlatGrads(params).attach()
        return self.flat

    def all_reduce(self) -> None:
        """Average the buffer over the ranks, as DDP averages the grads."""
        self.flat.all_reduce(average=True)

    def row(self, when: str) -> Row:
        """The change's report row; ``when``: when the all-reduce runs."""
        sizes = ", ".join(f"{b.numel() / 1e6:.1f}M {str(b.dtype).removeprefix('torch.')}"
                          for b in self.flat.buffers.values())
        return Row(self.kind, "all-reduce", ON, f"DDP's reducer off: the grads averaged by one all-reduce of "
                   f"one flat buffer ({sizes}) per optimizer step, {when}")


__all__ = ["FlatAllReduce"]
