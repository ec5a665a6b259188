"""What FusedTraining's changes see of a run (:class:`Run`), and the Lightning hooks a change may
act on (:class:`Change`, a :class:`trainfuse.clients.Change`).

FusedTraining walks its list of changes in order at fit start and undoes the applied ones in
reverse order when training ends, at teardown, or on an exception: each change undoes what would
leave the run unlike stock Lightning, on every path.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from trainfuse import clients
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


class Change(clients.Change[Run]):
    """One thing FusedTraining changes in a run (:class:`trainfuse.clients.Change`), with the
    Lightning hooks it may act on while the fit runs; each has a do-nothing default."""

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
