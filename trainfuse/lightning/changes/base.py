"""The shape of every change FusedTraining makes to a run: a small object that says why it does
not apply, applies, says what runs now, and undoes itself.

FusedTraining walks its list of changes in order at fit start and undoes the applied ones in
reverse order when training ends, at teardown, or on an exception: each change undoes what would
leave the run unlike stock Lightning, on every path. Modelled on Composer's algorithms (each
declares what it changes and reports when it matched nothing) and Lightning's WeightAveraging
callbacks (hooks named for when they act).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from trainfuse.clients import Row
from trainfuse.optim import FusedOptimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclasses.dataclass
class Run:
    """One fit as the changes see it: the Trainer, the module, and what earlier changes left
    for later ones.

    Attributes:
        trainer: the running Trainer.
        module: its LightningModule.
        device: the strategy's root device.
        kernels: whether the fused optimizers run their Triton kernels there (else torch's path).
        precision: the Trainer's precision as Lightning names it (``"bf16-mixed"``...).
        strategy: ``"single"``, ``"ddp"``, ``"fsdp"`` (FSDPStrategy), ``"fsdp2"``
            (ModelParallelStrategy), or the class name of a strategy FusedTraining leaves.
        shard_group: under FSDPStrategy, the process group the params are sharded over (set by
            the strategy's change; the swapped optimizers clip with every rank's shards). FSDP2's
            DTensor params name their group themselves.
        swapped: the fused optimizers that replaced the user's (set by the optimizer swap).
        all_swapped: whether every optimizer of the run was swapped (and there is one at least).
    """

    trainer: pl.Trainer
    module: pl.LightningModule
    device: torch.device
    kernels: bool
    precision: str
    strategy: str
    shard_group: Any = None
    swapped: list[FusedOptimizer] = dataclasses.field(default_factory=list)
    all_swapped: bool = False

    @property
    def sole_optimizer(self) -> FusedOptimizer | None:
        """The swapped optimizer when it is the run's only optimizer (it can hold the float32
        masters and fold the EMA into its step), else None."""
        return self.swapped[0] if self.all_swapped and len(self.swapped) == 1 else None


class Change:
    """One thing FusedTraining changes in a run.

    Subclasses set :attr:`kind` and override what they need; every method has a do-nothing
    default. The callback, for each change in order: writes an ``off`` row if :meth:`why_off`
    gives a reason, else a ``skipped`` row if :meth:`why_not` does (and, for a change that
    :attr:`ends_run`, changes nothing more), else calls :meth:`apply` and writes :meth:`rows`.
    """

    kind: ClassVar[str]
    # a skip of this change leaves the whole run stock (an unsupported precision or strategy)
    ends_run: ClassVar[bool] = False

    def name(self, run: Run) -> str:
        """What the change's ``off``/``skipped`` row is about."""
        return "-"

    def why_off(self, run: Run) -> str | None:
        """Why there is nothing to change (turned off, or nothing matched): an ``off`` row."""
        return None

    def why_not(self, run: Run) -> str | None:
        """Why this run cannot take the change: a ``skipped`` row. None: it can."""
        return None

    def apply(self, run: Run) -> None:
        """Make the change."""

    def rows(self, run: Run) -> list[Row]:
        """After :meth:`apply`: what runs now, one row per thing changed or left alone."""
        return []

    def restore(self, run: Run, *, failed: bool) -> None:
        """Undo the change (in reverse order of the list). ``failed``: the fit raised (Lightning
        calls ``on_exception``); else training ended (``on_train_end``, or ``teardown`` for a
        fit that ran no training loop)."""

    # ---- while the fit runs --------------------------------------------------------------------
    def before_batch(self, run: Run, batch_idx: int) -> None:
        """A training batch begins (``on_train_batch_start``)."""

    def before_backward(self, run: Run) -> None:
        """A training backward is about to run, after the step's ``zero_grad``
        (``on_before_backward``)."""

    def after_batch(self, run: Run) -> None:
        """After a training batch (``on_train_batch_end``)."""

    def before_optimizer_step(self, run: Run, optimizer: torch.optim.Optimizer) -> None:
        """The grads of a step are complete, before clipping and the step
        (``on_before_optimizer_step``)."""

    def validation_starts(self, run: Run) -> None:
        """A validation epoch inside the fit begins."""

    def validation_ends(self, run: Run) -> None:
        """A validation epoch inside the fit ended."""


def describe(run: Run, kernels: str, torch_path: str) -> str:
    """``kernels`` where the Triton kernels run, ``torch_path`` where torch's path does."""
    return kernels if run.kernels else torch_path


__all__ = ["Change", "Run", "describe"]
