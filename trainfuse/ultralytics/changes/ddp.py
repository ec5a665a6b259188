"""Under DDP with CUDA graphs: DDP's wrapper gives way to one all-reduce of a flat buffer before
each optimizer step (:class:`trainfuse.clients.FlatAllReduce`).

ultralytics does not use ``no_sync``, so DDP all-reduces every micro-batch; the replays accumulate
the micro-batches' grads in place into views of one flat buffer instead, and one all-reduce of it
runs when the loop calls ``optimizer_step``. The model runs without its DDP wrapper meanwhile (its
reducer's hooks idle: no forward goes through it), and gets it back at the end.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from trainfuse.clients import FlatAllReduce, Row
from trainfuse.ultralytics.changes.base import Change, Run
from trainfuse.ultralytics.changes.graphs import why_no_graphs


class FlatGradsDDP(FlatAllReduce[Run], Change):
    """The DDP wrapper's reducer -> one flat all-reduce per optimizer step (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._wrapper: torch.nn.Module | None = None

    @override
    def why_off(self, run: Run) -> str | None:
        if not (run.trainer.world_size > 1 and torch.distributed.is_available()
                and torch.distributed.is_initialized()):
            return "not a DDP run"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        why = why_no_graphs(run)
        return None if why is None else f"DDP's own reducer stays: no CUDA graphs ({why})"

    @override
    def apply(self, run: Run) -> None:
        self._wrapper = run.trainer.model
        run.trainer.model = model = run.model  # the replays run the model itself
        run.flat = self.make_flat(model.parameters())

    @override
    def rows(self, run: Run) -> list[Row]:
        return [self.row(f"after the replays, across {run.trainer.world_size} ranks")]

    @override
    def before_optimizer_step(self, run: Run) -> None:
        self.all_reduce()  # of the grads of loss * world_size, as DDP averages

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        self.flat.detach()  # the process group ends with training
        self.flat = run.flat = None
        run.trainer.model = self._wrapper
        self._wrapper = None


__all__ = ["FlatGradsDDP"]
