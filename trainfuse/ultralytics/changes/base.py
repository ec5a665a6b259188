"""What the ultralytics trainer's changes see of a run (:class:`Run`), and the loop's moments a
change may act on (:class:`Change`, a :class:`trainfuse.clients.Change`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from ultralytics.utils.torch_utils import unwrap_model

from trainfuse import clients
from trainfuse.clients import FlatGrads
from trainfuse.graphs import GraphedOptimizerStep, StepStats
from trainfuse.optim import FusedOptimizer
from trainfuse.ultralytics.graphed import GraphedLoss
from trainfuse.ultralytics.loading import BatchLoading


@dataclasses.dataclass
class Options:
    """The trainer's options (its constructor's keywords; a subclass's class attributes are their
    defaults, which is what DDP's ranks, rebuilt from the class, see)."""

    fused_loss: bool
    fuse_casts: bool
    cuda_graphs: bool
    fold_stem: bool
    fuse_blocks: bool | None = None
    device_cache: bool | None = None
    cudnn_benchmark: bool = False
    raw_images: bool = False


@dataclasses.dataclass
class Results:
    """What the last run's graphs did, kept after training (None where they did not run)."""

    graph_stats: StepStats | None = None
    graph_memory: Any = None
    phase_stats: dict[str, int] | None = None


@dataclasses.dataclass
class Run:
    """One training run as the changes see it: the trainer, its options and loading, and what
    earlier changes left for later ones.

    Attributes:
        trainer: the running ``FusedDetectionTrainer`` (ultralytics' ``DetectionTrainer``).
        options: its options.
        loading: its training batches' loading (what it decided at the dataset's build).
        reloading: the changes are undone around a checkpoint load (NaN recovery) and made again
            after it, rather than for good.
        uint8_images: the training batches reach the model as uint8 images (the images change).
        flat: under DDP with graphs, the grads as views of one flat buffer (the DDP change).
        graphed: the step's forward, loss and backward from CUDA graphs (the graphs change).
        phase: the optimizer phase replayed from graphs (the phase change).
        results: what the graphs did, filled as they are dropped.
    """

    trainer: Any
    options: Options
    loading: BatchLoading
    reloading: bool = False
    uint8_images: bool = False
    flat: FlatGrads | None = None
    graphed: GraphedLoss | None = None
    phase: GraphedOptimizerStep | None = None
    results: Results = dataclasses.field(default_factory=Results)

    @property
    def model(self) -> torch.nn.Module:
        """The trainer's model without its DDP wrapper."""
        return unwrap_model(self.trainer.model)

    @property
    def fused(self) -> FusedOptimizer | None:
        """The trainer's optimizer when it is a fused one."""
        opt = getattr(self.trainer, "optimizer", None)
        return opt if isinstance(opt, FusedOptimizer) else None

    @property
    def device(self) -> torch.device:
        return self.trainer.device


class Change(clients.Change[Run]):
    """One thing the trainer changes in a run (:class:`trainfuse.clients.Change`), with the loop's
    moments it may act on; each has a do-nothing default."""

    def before_optimizer_step(self, run: Run) -> None:
        """The loop calls ``optimizer_step``: the step's grads are complete."""

    def epoch_starts(self, run: Run) -> None:
        """A training epoch begins (``on_train_epoch_start``)."""

    def epoch_ends(self, run: Run) -> None:
        """A training epoch's batches are done (``on_train_epoch_end``, before validation)."""


def _moment(name: str):
    def callback(trainer) -> None:
        notify = getattr(trainer, "notify", None)  # a trainer that makes changes
        if notify is not None:
            notify(name)

    callback.__name__ = f"trainfuse_{name}"
    return callback


# ultralytics' events -> the changes' moments (a trainer adds these callbacks first in line)
CALLBACKS = {"on_train_epoch_start": _moment("epoch_starts"), "on_train_epoch_end": _moment("epoch_ends")}


__all__ = ["CALLBACKS", "Change", "Options", "Results", "Run"]
