"""CUDA graphs (``cuda_graphs=True``, the default where it is safe): forward, loss and backward
replayed per image shape and label capacity (:class:`~trainfuse.ultralytics.graphed.GraphedLoss`;
its inputs the labels the loss reads, :func:`graph_inputs`),
the grads kept and zeroed inside the next replay; and the fused optimizer phase of a capturable
optimizer under AMP, once steady, inside the graph of each iteration the loop steps after (under
DDP, a graph of its own: :class:`~trainfuse.graphs.GraphedOptimizerStep`). Off on CPU, with
``compile``, with a scaler other than torch's, or with a loss that syncs with the host (ultralytics'
own, but for classification's cross-entropy, which needs no fused counterpart).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from ultralytics.utils.loss import v8ClassificationLoss

from trainfuse.amp import GradScaler
from trainfuse.clients import ON, Row
from trainfuse.graphs import GraphedOptimizerStep
from trainfuse.ultralytics import compat
from trainfuse.ultralytics.changes.base import Change, Run
from trainfuse.ultralytics.changes.loss import FUSED_LOSSES
from trainfuse.ultralytics.graphed import GraphedLoss


def graph_inputs(loss: Any) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """What the step's graphs feed ``loss`` besides the image, and what its items are called:
    ``(keys, names)``, or None where no graph can run it. A fused loss names its keys
    (``graph_keys``); ultralytics' classification loss (exactly it: a subclass may sync) reads the
    classes; any other loss of ultralytics' syncs with the host."""
    if type(loss) is v8ClassificationLoss:
        return ("cls",), ("loss",)
    if isinstance(loss, FUSED_LOSSES) and loss.graph_keys is not None:
        return tuple(loss.graph_keys), tuple(loss.loss_names)
    return None


def criterion_of(model: torch.nn.Module) -> Any:
    """``model``'s criterion; ultralytics makes it at the first ``loss`` call, so one made now where
    there is none yet (the same ``init_criterion()``); None for a model without one."""
    loss = getattr(model, "criterion", None)
    if loss is None and callable(getattr(model, "init_criterion", None)):
        loss = model.init_criterion()
    return loss


def why_no_graphs(run: Run) -> str | None:
    """Why the step cannot run from CUDA graphs here (None when it can)."""
    if not run.options.cuda_graphs:
        return "cuda_graphs=False"
    if run.device.type != "cuda":
        return f"the device is {run.device.type}, not CUDA"
    if run.trainer.args.compile:
        return "compile is on"
    if not isinstance(run.trainer.scaler, GradScaler):
        return f"the scaler is {type(run.trainer.scaler).__name__}, not torch's GradScaler"
    loss = criterion_of(run.model)
    if graph_inputs(loss) is not None:
        return None
    if loss is None:
        return f"{type(run.model).__name__} has no criterion (no init_criterion) for the graphs to replay"
    if isinstance(loss, FUSED_LOSSES):
        return (f"{type(loss).__name__} reads labels whose shape changes from batch to batch (overlap_mask="
                "False: one mask per label), so the step runs eagerly (its loss without host syncs)")
    return f"the model trains with ultralytics' own {type(loss).__name__}, which syncs with the host"


class Graphs(Change):
    """The model's training ``loss`` -> a GraphedLoss (module docstring)."""

    kind = "graphs"

    def __init__(self) -> None:
        self.graphed: GraphedLoss | None = None

    @override
    def name(self, run: Run) -> str:
        return "cuda_graphs"

    @override
    def why_off(self, run: Run) -> str | None:
        return "cuda_graphs=False" if not run.options.cuda_graphs else None

    @override
    def why_not(self, run: Run) -> str | None:
        return why_no_graphs(run)

    @override
    def apply(self, run: Run) -> None:
        ddp = run.flat is not None  # ultralytics' loss * world_size, averaged: DDP's arithmetic
        model = run.model
        model.criterion = criterion_of(model)
        keys, names = graph_inputs(model.criterion)
        self.graphed = run.graphed = GraphedLoss(
            model, run.trainer.scaler, grads=run.flat.grads if ddp else None,
            loss_factor=run.trainer.world_size if ddp else 1, paced=self.paced(run), keys=keys,
            names=names).attach()

    @staticmethod
    def paced(run: Run) -> bool:
        """Beside the GPU JPEG decoding's thread, each replay waits for the last one."""
        return run.loading.jpeg_decoder is not None

    @override
    def rows(self, run: Run) -> list[Row]:
        return [Row(self.kind, "cuda_graphs", ON, "forward, loss and backward replayed from CUDA graphs (one "
                    "per image shape and label capacity; each shape's first batch runs eagerly)"
                    + ("; paced: each replay waits for the last, beside the GPU decoding" if self.paced(run)
                       else ""))]

    @override
    def epoch_starts(self, run: Run) -> None:
        self.graphed.readout.start_epoch()

    @override
    def epoch_ends(self, run: Run) -> None:
        """The exact per-epoch loss means in ``trainer.tloss`` (what the epoch logs), and the last
        iteration's loss items, on the GPU as ultralytics' validator expects them, in
        ``trainer.loss_items``."""
        means = self.graphed.epoch_means()
        if means is not None:
            run.trainer.tloss = means
            run.trainer.loss_items = self.graphed.last_items()

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        step = self.graphed.step
        run.results.graph_stats, run.results.graph_memory = step.stats, step.memory_report()
        self.graphed.detach()  # the model's own loss back, the graphs and their kept grads freed
        self.graphed = run.graphed = None


class Phase(Change):
    """The fused optimizer phase from CUDA graphs (module docstring)."""

    kind = "phase"

    def __init__(self) -> None:
        self.phase: GraphedOptimizerStep | None = None

    @override
    def name(self, run: Run) -> str:
        return "optimizer phase"

    @override
    def why_off(self, run: Run) -> str | None:
        return None if run.graphed is not None else "the step runs eagerly (no CUDA graphs)"

    @override
    def why_not(self, run: Run) -> str | None:
        fused = run.fused
        if fused is None:
            return f"the optimizer is stock {type(run.trainer.optimizer).__name__}"
        if not fused.capturable:
            return f"{type(fused).__name__} is not capturable (its step cannot replay from a CUDA graph)"
        if not run.trainer.scaler.is_enabled():
            return "AMP is off (GradScaler disabled)"
        if run.flat is None:
            return compat.why_not_stepping_rule(type(run.trainer))
        return None

    @override
    def apply(self, run: Run) -> None:
        self.phase = run.phase = GraphedOptimizerStep(run.fused, run.trainer.scaler)
        if run.flat is None:  # under DDP, the all-reduce comes between the backward and the phase
            run.graphed.fold_phase(self.phase, lambda: run.trainer.accumulate)

    @override
    def rows(self, run: Run) -> list[Row]:
        where = ("replayed from one CUDA graph of its own" if run.flat is not None
                 else "run inside the graph of each iteration the loop steps after")
        return [Row(self.kind, "optimizer phase", ON, f"optimizer phase (unscale, inf check, clip, step, "
                    f"EMA, scale update) {where}, after its first steady steps; lr, momentum and the EMA "
                    "weight written to the device before")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        phase = self.phase
        run.results.phase_stats = {"eager": phase.eager, "captures": phase.captures, "replays": phase.replays,
                                   "folded": phase.folded}
        phase.close()
        self.phase = run.phase = None


__all__ = ["Graphs", "Phase", "criterion_of", "graph_inputs", "why_no_graphs"]
