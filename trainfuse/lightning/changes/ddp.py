"""Under DDP: the grads averaged by one all-reduce of one flat buffer per optimizer step, DDP's
reducer off.

DDP registers a hook on every param and all-reduces a bucket whenever its grads are ready, on
the host's time: for a small or mid-size model a host-bound step grows by the hooks and the
per-bucket launches. A backward replayed from a CUDA graph runs no hook at all. So the change turns
the reducer off for the fit (``require_backward_grad_sync = False``, what ``no_sync()`` sets;
Lightning's own ``no_sync`` during accumulation restores that value) and gives every param's grad
a home in one flat buffer (:class:`trainfuse.clients.FlatGrads`): the graphs accumulate into those
views, and before an eager backward they are the params' grads again (zeroed after
``zero_grad``), so it adds into them in place. When the step's grads are complete
(``on_before_optimizer_step``: after the accumulation's last micro-batch, before clipping, the
inf check and the step), one all-reduce averages the buffer as DDP does (divide by the world
size, sum), and every rank steps from the same grads.

With the casts on (16-bit params with float32 masters in the optimizer) the buffer of the cast
params is 16-bit, as their grads are, and so is its all-reduce, as DDP's over 16-bit params is.

What differs from DDP: the all-reduce runs after the backward instead of overlapping with it, and
it covers every trainable param each step (DDP with ``find_unused_parameters=True`` reduces only
the ones a step used; an unused param gets zeros here).
"""

from __future__ import annotations

import torch

from trainfuse.clients import ON, FlatGrads, Row
from trainfuse.lightning.changes.base import Change, Run


def why_not_flat(run: Run) -> str | None:
    """Why a DDP run keeps DDP's own reducer, or None when :class:`FlatAllReduce` replaces it
    (then the params' grads are ours to lay out: the casts may make them 16-bit)."""
    if run.strategy != "ddp":
        return "not a DDP run"
    if not isinstance(run.trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):
        return "the DDP strategy holds no DistributedDataParallel model: DDP's own reducer stays"
    if run.precision == "16-mixed" and not run.all_swapped:
        return ("16-mixed with a stock optimizer: Lightning's GradScaler unscales and looks for inf in "
                "each rank's grads before this all-reduce could run; DDP's own reducer stays")
    return None


class FlatAllReduce(Change):
    """DDP's gradient all-reduce as one collective per optimizer step (module docstring)."""

    kind = "ddp"

    def __init__(self) -> None:
        self.flat: FlatGrads | None = None
        self.graphed = False  # the Graphs change replays the backward into the views
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None

    def name(self, run: Run) -> str:
        return "all-reduce"

    def why_not(self, run: Run) -> str | None:
        return why_not_flat(run)

    def apply(self, run: Run) -> None:
        self.flat = FlatGrads(run.module.parameters()).attach()
        self._views = {id(p): g for p, g in zip(self.flat.params, self.flat.grads)}
        self._ddp = run.trainer.strategy.model
        self._ddp.require_backward_grad_sync = False  # DDP's hooks stay idle: the all-reduce is ours

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s grad in the flat buffer (the kept grad a graph accumulates into), or None."""
        return None if self.flat is None else self._views.get(id(param))

    def before_backward(self, run: Run) -> None:
        # an eager backward then adds into the views in place: no fresh grads to copy in after it
        # (a replayed backward writes the views itself: the zeros would only make it add)
        if self.flat is not None and not self.graphed:
            self.flat.attach()

    def before_optimizer_step(self, run: Run, optimizer: torch.optim.Optimizer) -> None:
        if self.flat is not None:
            self.flat.attach()  # grads a backward made elsewhere (say, a custom hook) go into the buffer
            self.flat.all_reduce(average=True)

    def rows(self, run: Run) -> list[Row]:
        sizes = ", ".join(f"{b.numel() / 1e6:.1f}M {str(b.dtype).removeprefix('torch.')}"
                          for b in self.flat.buffers.values())
        return [Row(self.kind, self.name(run), ON, f"DDP's reducer off: the grads averaged by one all-reduce "
                    f"of one flat buffer ({sizes}) per optimizer step, after the backward")]

    def restore(self, run: Run, *, failed: bool) -> None:
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = True
            self._ddp = None
        self.flat = None  # the params keep the grads they hold (views of the buffer)


__all__ = ["FlatAllReduce", "why_not_flat"]
