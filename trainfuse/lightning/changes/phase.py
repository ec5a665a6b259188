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

Every optimizer of the run is a fused one, on one CUDA device; it is on wherever graphs are, and
``TRAINFUSE_GRAPH_LIGHTNING_PHASE=0`` keeps the step eager. One optimizer stepped by the Trainer
(automatic optimization) under 32-true and bf16-mixed: one graphed step. Several optimizers, or a
module that steps its optimizers itself (manual optimization: Muon's users step Muon and AdamW):
a graphed step per optimizer, each ``opt.step()`` its replay, after whatever the module does to
the grads before (its ``clip_gradients``). Under 16-mixed (trainfuse's GradScaler in the
precision plugin, one optimizer the Trainer steps) the graph holds the scaler's step and update
too (``GraphedOptimizerStep`` with the scaler: the inf check, clip, update, EMA and the scale's
update), and the plugin's ``optimizer_step`` runs the closure, Lightning's hooks before the step,
then that graph in place of the scaler's ``step`` and ``update``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from typing_extensions import override

from trainfuse._runtime import compat
from trainfuse.amp import GradScaler
from trainfuse.clients import ON, Row
from trainfuse.graphs import GraphedOptimizerStep
from trainfuse.lightning import _compat
from trainfuse.lightning.changes.base import Change, Run
from trainfuse.lightning.changes.graphs import Graphs
from trainfuse.optim import FusedOptimizer

GRAPH_PHASE = "TRAINFUSE_GRAPH_LIGHTNING_PHASE"


class _GraphedStep:
    """An optimizer's ``step(closure)``: the closure (with grad on, as torch's optimizers run it),
    then the phase's replay (or eager step)."""

    def __init__(self, phase: GraphedOptimizerStep) -> None:
        self.phase = phase
        self._running = False

    def __call__(self, opt: FusedOptimizer, closure: Any = None, **kwargs: Any) -> Any:
        if self._running:  # the scaler's own step, where the phase falls back to it: the class's step
            return type(opt).step(opt, closure, **kwargs)
        if kwargs:
            raise TypeError(f"{type(opt).__name__}.step() got unexpected keyword arguments {sorted(kwargs)} "
                            "(a graphed optimizer step takes only a closure)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._running = True
        try:
            self.phase()
        finally:
            self._running = False
        return loss


class _ScaledPluginStep:
    """The 16-mixed precision plugin's ``optimizer_step`` for the graphed optimizer: the closure,
    the plugin's steps between the closure and the step (Lightning's ``on_before_optimizer_step``
    hooks, its clipping), then ``opt.step()`` (the phase: the scaler's step and update from one
    graph). The fused optimizer needs no ``unscale_`` before (it divides by the scale inside its
    step). Any other optimizer, or extra arguments, take the plugin's own method."""

    def __init__(self, plugin: Any, opt: FusedOptimizer) -> None:
        self.plugin, self.opt = plugin, opt

    def __call__(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        if optimizer is not self.opt or kwargs:
            own = type(self.plugin).optimizer_step
            return own(self.plugin, optimizer, model=model, closure=closure, **kwargs)
        result = closure()
        _compat.after_closure(self.plugin, model, optimizer)
        if result is None and model.automatic_optimization:  # the backward was skipped: no step
            return result
        return optimizer.step()


class OptimizerPhase(Change):
    """Each fused optimizer's step replayed from a CUDA graph of its own (module docstring); the
    optimizers' own ``step`` back at the end.

    Args:
        graphs: the run's graphs change (the phase needs its kept grads).
    """

    kind = "optimizer_graph"

    def __init__(self, graphs: Graphs) -> None:
        self.graphs = graphs
        # per optimizer: its phase, and its instance step before and ours
        self._entries: list[tuple[GraphedOptimizerStep, Any, Any]] = []
        self._plugin_step: _ScaledPluginStep | None = None  # 16-mixed: the plugin's optimizer_step
        self.stats: dict[str, int] | None = None  # the last fit's eager steps, captures, replays

    @property
    def phases(self) -> list[GraphedOptimizerStep]:
        """This fit's graphed steps, one per optimizer (empty where the change is off)."""
        return [phase for phase, _, _ in self._entries]

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
        if not run.all_swapped:
            return "an optimizer of the run is not a fused one"
        for opt in run.swapped:
            if not type(opt).capturable:
                return f"{type(opt).__name__} is not capturable"
        if run.precision == "16-mixed":
            scaler = getattr(run.trainer.precision_plugin, "scaler", None)
            if not isinstance(scaler, GradScaler) or not scaler.is_enabled():
                what = "no scaler" if scaler is None else f"{type(scaler).__module__}.{type(scaler).__name__}"
                return f"16-mixed with {what}, not an enabled trainfuse.amp.GradScaler"
            if run.sole_optimizer is None or not run.module.automatic_optimization:
                return "16-mixed: the scaler's step is graphed for one optimizer the Trainer steps"
        elif run.precision not in ("32-true", "bf16-mixed"):
            return f"precision {run.precision}"
        return None

    @override
    def apply(self, run: Run) -> None:
        scaler = run.trainer.precision_plugin.scaler if run.precision == "16-mixed" else None
        for opt in run.swapped:
            before = opt.__dict__.get("step")  # an LR scheduler's wrapper, or none
            phase = GraphedOptimizerStep(opt, scaler)
            # Lightning's precision plugin calls optimizer.step(closure), and a module under manual
            # optimization opt.step(); marked as a scheduler's wrapper marks it, so that the run's
            # schedulers see their optimizer stepped
            compat.mark_step_for_schedulers(opt, _GraphedStep(phase))
            self._entries.append((phase, before, opt.__dict__["step"]))
        if scaler is not None:
            plugin = run.trainer.precision_plugin
            plugin.optimizer_step = self._plugin_step = _ScaledPluginStep(plugin, run.swapped[0])

    @override
    def rows(self, run: Run) -> list[Row]:
        what = ("inf check, clip, update, EMA and the scale's update" if self._plugin_step is not None
                else "clip, update and EMA")
        return [Row(self.kind, type(phase.optimizer).__name__, ON, f"{what} replayed from one CUDA graph "
                    "after two steady eager steps; lr and the EMA weight written to the device before each")
                for phase in self.phases]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if not self._entries:
            return
        phases = self.phases
        self.stats = {key: sum(getattr(p, key) for p in phases) for key in ("eager", "captures", "replays")}
        ours = self._plugin_step
        if ours is not None and ours.plugin.__dict__.get("optimizer_step") is ours:
            del ours.plugin.optimizer_step
        self._plugin_step = None
        for phase, before, step in self._entries:
            opt = phase.optimizer
            if opt.__dict__.get("step") is step:
                if before is None:
                    del opt.step
                else:
                    opt.step = before
            phase.close()
        self._entries = []


__all__ = ["GRAPH_PHASE", "OptimizerPhase"]
