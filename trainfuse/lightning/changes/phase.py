"""The optimizer phase of a graphed Lightning run replayed from a CUDA graph of its own.

With ``cuda_graphs=True`` the model's forward and backward replay from graphs, and the grads they
write stay at fixed addresses (the graphed modules' kept grads). The fused optimizer's step then
reads the same tensors every step, so its launches (clip, update, EMA) can be captured once and
replayed: :class:`trainfuse.graphs.GraphedOptimizerStep` without a scaler, which runs the step
eagerly until what a graph would hold is steady (two eager steps), captures it, and replays it
while the tables, params, grads and EMA stay as captured (else eagerly again, and a later step
captures anew). Lightning's closure (``training_step``, backward, ``on_before_optimizer_step``)
runs as before; the step's host part (the EMA's count and weight, the groups' hyperparameters
after the LR scheduler) is written to the device before each replay.

Only where no GradScaler runs (32-true, bf16-mixed), one fused optimizer steps the whole run on
one CUDA device, and the Trainer steps it (automatic optimization). On wherever graphs are;
``TRAINFUSE_GRAPH_LIGHTNING_PHASE=0`` keeps the step eager.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from typing_extensions import override

from trainfuse._runtime import compat
from trainfuse.clients import ON, Row
from trainfuse.graphs import GraphedOptimizerStep
from trainfuse.lightning.changes.base import Change, Run
from trainfuse.lightning.changes.graphs import Graphs
from trainfuse.optim import FusedOptimizer

GRAPH_PHASE = "TRAINFUSE_GRAPH_LIGHTNING_PHASE"


class _GraphedStep:
    """An optimizer's ``step(closure)``: the closure (with grad on, as torch's optimizers run it),
    then the phase's replay (or eager step)."""

    def __init__(self, phase: GraphedOptimizerStep) -> None:
        self.phase = phase

    def __call__(self, opt: FusedOptimizer, closure: Any = None, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"{type(opt).__name__}.step() got unexpected keyword arguments {sorted(kwargs)} "
                            "(a graphed optimizer step takes only a closure)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.phase()
        return loss


class OptimizerPhase(Change):
    """The fused optimizer's step replayed from a CUDA graph (module docstring); the optimizer's
    own ``step`` back at the end.

    Args:
        graphs: the run's graphs change (the phase needs its kept grads).
    """

    kind = "optimizer_graph"

    def __init__(self, graphs: Graphs) -> None:
        self.graphs = graphs
        self.phase: GraphedOptimizerStep | None = None
        self.stats: dict[str, int] | None = None  # the last fit's eager steps, captures, replays
        self._steps: tuple[Any, Any] | None = None  # the optimizer's instance step before, and ours

    @override
    def name(self, run: Run) -> str:
        return "optimizer step"

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.graphs.enabled:
            return "cuda_graphs=False"
        if os.environ.get(GRAPH_PHASE) == "0":
            return f"{GRAPH_PHASE}=0"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        if not self.graphs.installed:
            return "forward and backward run eagerly: the grads have no fixed addresses to step from"
        if run.strategy != "single":
            return f"{run.strategy}: the graphed step is for single-device runs"
        if not run.module.automatic_optimization:
            return "manual optimization: the module steps its optimizers itself"
        opt = run.sole_optimizer
        if opt is None:
            return "the run has several optimizers, or one the fused step does not take"
        if not type(opt).capturable:
            return f"{type(opt).__name__} is not capturable"
        if run.precision == "16-mixed":
            return "16-mixed: Lightning's GradScaler steps and updates in calls of its own"
        if run.precision not in ("32-true", "bf16-mixed"):
            return f"precision {run.precision}"
        return None

    @override
    def apply(self, run: Run) -> None:
        opt = run.sole_optimizer
        assert isinstance(opt, FusedOptimizer)
        before = opt.__dict__.get("step")  # an LR scheduler's wrapper, or none
        self.phase = GraphedOptimizerStep(opt, None)
        # Lightning's precision plugin calls optimizer.step(closure); marked as a scheduler's
        # wrapper marks it, so that the run's schedulers see their optimizer stepped
        compat.mark_step_for_schedulers(opt, _GraphedStep(self.phase))
        self._steps = (before, opt.__dict__["step"])

    @override
    def rows(self, run: Run) -> list[Row]:
        opt = run.sole_optimizer
        return [Row(self.kind, type(opt).__name__, ON, "clip, update and EMA replayed from one CUDA graph "
                    "after two steady eager steps; lr and the EMA weight written to the device before each")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        phase = self.phase
        if phase is None:
            return
        self.stats = {"eager": phase.eager, "captures": phase.captures, "replays": phase.replays}
        opt = phase.optimizer
        before, ours = self._steps
        if opt.__dict__.get("step") is ours:
            if before is None:
                del opt.step
            else:
                opt.step = before
        phase.close()
        self.phase = self._steps = None


__all__ = ["GRAPH_PHASE", "OptimizerPhase"]
