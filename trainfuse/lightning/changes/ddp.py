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

With ``cuda_graphs=True``, when one graphed module's backward reaches every trainable param (a
LightningModule whose ``forward`` runs the whole model), the backward of the accumulation's last
micro-batch is captured with the all-reduce inside it, in buckets of about 25 MB launched as the
backward produces their grads (:class:`trainfuse.clients.GradBuckets`): the communication overlaps
the rest of the backward, as DDP's does, and the replay leaves the grads averaged, so nothing is
left to launch before the step. The last micro-batch is told by the batch index
(``accumulate_grad_batches``, the epoch's last batch); a guess that is wrong costs an extra
all-reduce, never a missing one (averaging twice changes nothing; the step's grads are averaged
after the backward whenever its last backward did not reduce them).

What differs from DDP: without graphs the all-reduce runs after the backward instead of
overlapping with it, and it covers every trainable param each step (DDP with
``find_unused_parameters=True`` reduces only the ones a step used; an unused param gets zeros here).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from typing_extensions import override

from trainfuse import clients
from trainfuse.clients import GradBuckets, Row
from trainfuse.lightning.changes.base import Change, Run


def why_not_flat(run: Run) -> str | None:
    """Why a DDP run keeps DDP's own reducer, or None when :class:`FlatAllReduce` replaces it
    (then the params' grads are ours to lay out: the casts may make them 16-bit)."""
    if run.strategy != "ddp":
        return "not a DDP run"
    if not isinstance(run.trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):
        return "the DDP strategy holds no DistributedDataParallel model: DDP's own reducer stays"
    if not run.module.automatic_optimization:
        return ("manual optimization: the module steps its optimizers itself, each step would all-reduce "
                "again; DDP's own reducer stays")
    if run.precision == "16-mixed" and not run.all_swapped:
        return ("16-mixed with a stock optimizer: Lightning's GradScaler unscales and looks for inf in "
                "each rank's grads before this all-reduce could run; DDP's own reducer stays")
    return None


class FlatAllReduce(clients.FlatAllReduce[Run], Change):
    """DDP's gradient all-reduce as one collective per optimizer step (module docstring; the
    buffer, its all-reduce and its row are :class:`trainfuse.clients.FlatAllReduce`'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.graphed = False  # the Graphs change replays the backward into the views
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._buckets: GradBuckets | None = None
        self._boundary = True  # the batch now running ends the accumulation
        self._reduced = False  # the step's last backward averaged the grads (a replayed graph)
        self.overlapped = 0  # steps whose grads a replayed backward averaged

    @override
    def why_not(self, run: Run) -> str | None:
        return why_not_flat(run)

    @override
    def apply(self, run: Run) -> None:
        self.make_flat(run.module.parameters())
        self._views = {id(p): g for p, g in zip(self.flat.params, self.flat.grads)}
        self._ddp = run.trainer.strategy.model
        self._ddp.require_backward_grad_sync = False  # DDP's hooks stay idle: the all-reduce is ours
        self._buckets = GradBuckets(self.flat)

    # ---- the graphs' gradient sync (trainfuse.graphs.BackwardSync) -------------------------------
    def active(self) -> bool:
        """Whether the forward now running belongs to the accumulation's last micro-batch."""
        return self._boundary

    def start(self, leaves: list[torch.Tensor], kept: list[torch.Tensor], zero: bool):
        """The bucketed all-reduce of a backward being captured (NCCL only: gloo cannot be captured)."""
        if self._buckets is None or dist.get_backend(self.flat.group) != "nccl":
            return None
        return self._buckets.start(leaves, kept, zero)

    def replayed(self) -> None:
        self._reduced = True

    def buckets(self) -> int:
        """How many buckets a replayed backward all-reduces."""
        return 0 if self._buckets is None else len(self._buckets.buckets)

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s grad in the flat buffer (the kept grad a graph accumulates into), or None."""
        return None if self.flat is None else self._views.get(id(param))

    @override
    def before_batch(self, run: Run, batch_idx: int) -> None:
        trainer = run.trainer
        last = trainer.num_training_batches
        self._boundary = ((batch_idx + 1) % trainer.accumulate_grad_batches == 0
                          or (not math.isinf(last) and batch_idx + 1 >= last))

    @override
    def before_backward(self, run: Run) -> None:
        self._reduced = False  # only the step's last backward counts
        # an eager backward then adds into the views in place: no fresh grads to copy in after it
        # (a replayed backward writes the views itself: the zeros would only make it add)
        if self.flat is not None and not self.graphed:
            self.flat.attach()

    @override
    def before_optimizer_step(self, run: Run, optimizer: torch.optim.Optimizer) -> None:
        if self.flat is None:
            return
        self.flat.attach()  # grads a backward made elsewhere (say, a custom hook) go into the buffer
        if self._reduced and not self.flat.copied:  # None grads became zeros: zero on every rank
            self.overlapped += 1
            return
        self.all_reduce()

    @override
    def rows(self, run: Run) -> list[Row]:
        return [self.row("after the backward")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = True
            self._ddp = None
        self.flat = None  # the params keep the grads they hold (views of the buffer)
        self._buckets = None


__all__ = ["FlatAllReduce", "why_not_flat"]
