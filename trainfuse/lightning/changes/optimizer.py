"""The optimizer swap and the Trainer's clipping folded into the fused step.

Each of the run's ``torch.optim`` optimizers with a fused counterpart in
:mod:`trainfuse.optim.registry` is replaced by it (:func:`trainfuse.clients.swap_optimizer`: the
same group dicts, Parameter objects and state), every LR scheduler driving it re-pointed; the
Trainer's ``gradient_clip_val`` becomes the fused step's ``max_grad_norm``/``max_grad_value``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from trainfuse._runtime import compat
from trainfuse.clients import ON, SKIPPED, SWAPPED, Row, repoint_schedulers, swap_optimizer, why_not_swappable
from trainfuse.lightning import _compat
from trainfuse.lightning.changes.base import Change, Run, describe
from trainfuse.optim import FusedOptimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl


def clipping_of(trainer: pl.Trainer) -> tuple[float | None, str]:
    """The Trainer's clipping: ``(gradient_clip_val, "norm" or "value")``, the value None when
    unset or 0."""
    value, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    algorithm = getattr(algorithm, "value", algorithm) or "norm"  # a GradClipAlgorithmType, or None
    return (float(value) if value is not None and value > 0 else None), algorithm


def _takes_no_grad_scaler(module: pl.LightningModule, swapped: list[FusedOptimizer]) -> None:
    """Under manual optimization without a GradScaler (bf16-mixed: one is refused), the swapped
    optimizers, and the wrappers ``module.optimizers()`` hands the module, say they take no scale
    from one: Lightning's mixed precision then clips their grads in the module's
    ``clip_gradients`` as it does a stock optimizer's, where it refuses an optimizer that unscales
    inside its step (the fused class's own setting, for GradScaler)."""
    wrappers = module.optimizers()
    wrappers = wrappers if isinstance(wrappers, list) else [wrappers]
    ours = {id(o) for o in swapped}
    for opt in [*swapped, *(w for w in wrappers if id(getattr(w, "optimizer", None)) in ours)]:
        setattr(opt, compat.STEP_SUPPORTS_AMP_SCALING, False)


class OptimizerSwap(Change):
    """Every optimizer of the run that the fused step can take -> its fused counterpart, clipping
    with the Trainer's setting inside the step; one row per optimizer.

    Decided before anything is swapped: an overridden ``configure_gradient_clipping``, and manual
    optimization under a GradScaler (16-mixed), clip through Lightning, which refuses optimizers
    that unscale inside their step; manual optimization without one (32-true, bf16-mixed) is
    swapped: the module's ``opt.step()`` steps the fused optimizer, and its ``clip_gradients``
    clips the grads as before (under bf16-mixed the fused optimizer tells Lightning that it takes
    no GradScaler's scale). Muon's users step Muon and AdamW that way: both are swapped.
    :func:`trainfuse.clients.why_not_swappable` gives every other reason (no counterpart, step
    hooks, options, sparse gradients from the module's embeddings).

    The fused optimizer stays in ``trainer.optimizers`` after the fit: it continues the user's
    (same groups, state and schedulers), its checkpoints are in torch.optim's layout, and the next
    fit builds its optimizers again from ``configure_optimizers``.
    """

    kind = "optimizer"

    def __init__(self) -> None:
        self._rows: list[Row] = []

    @override
    def why_off(self, run: Run) -> str | None:
        return None if run.trainer.strategy.optimizers else "configure_optimizers returned no optimizer"

    def _why_not(self, run: Run, opt: torch.optim.Optimizer) -> str | None:
        if not run.module.automatic_optimization and getattr(run.trainer.precision_plugin, "scaler",
                                                             None) is not None:
            return ("manual optimization under a GradScaler: training_step steps and clips it through "
                    "Lightning, which refuses to clip optimizers that unscale inside their step")
        if _compat.is_overridden("configure_gradient_clipping", run.module):
            return ("configure_gradient_clipping is overridden: it clips through Lightning, which refuses to "
                    "clip optimizers that unscale inside their step")
        return why_not_swappable(opt, kernels=run.kernels, module=run.module)

    @override
    def apply(self, run: Run) -> None:
        strategy = run.trainer.strategy
        clip, algorithm = clipping_of(run.trainer)
        by_norm = algorithm == "norm"
        schedulers = [config.scheduler for config in strategy.lr_scheduler_configs]
        result: list[torch.optim.Optimizer] = []
        for i, opt in enumerate(strategy.optimizers):
            name = f"optimizer {i} ({type(opt).__name__})"
            reason = self._why_not(run, opt)
            if reason is not None:
                self._rows.append(Row(self.kind, name, SKIPPED, reason))
                result.append(opt)
                continue
            new = swap_optimizer(opt, clip if by_norm else None, None if by_norm else clip)
            new.shard_group = run.shard_group  # FSDP: every rank's shards make the clipping norm
            moved = repoint_schedulers(schedulers, opt, new)
            detail = describe(run, f"{type(new).__name__}: every param's update in one multi-tensor launch",
                              f"{type(new).__name__}: on the torch path torch.optim's {type(opt).__name__} "
                              "math, group by group")
            if moved:
                detail += f"; {moved} LR scheduler{'s' if moved > 1 else ''} re-pointed"
            self._rows.append(Row(self.kind, name, SWAPPED, detail))
            result.append(new)
            run.swapped.append(new)
        if run.swapped:
            strategy.optimizers = result  # rebuilds the LightningOptimizer wrappers the loop steps
            if not run.module.automatic_optimization and run.precision.endswith("-mixed"):
                _takes_no_grad_scaler(run.module, run.swapped)
        run.all_swapped = bool(run.swapped) and len(run.swapped) == len(result)

    @override
    def rows(self, run: Run) -> list[Row]:
        return self._rows


class Clipping(Change):
    """``Trainer(gradient_clip_val=...)`` runs inside the fused step (the optimizer swap gave it
    the value), so the Trainer's own clipping is off for the run and comes back at the end. By
    norm, the pre-clip norm is logged as ``grad_norm`` (a device tensor) on the steps where the
    Trainer writes its logs."""

    kind = "clipping"

    def __init__(self, log_grad_norm: bool) -> None:
        self.log_grad_norm = log_grad_norm
        self._name = ""
        self._saved: tuple[Any, Any] = (None, None)
        self._norm_of: FusedOptimizer | None = None  # the optimizer whose step clips by norm

    @override
    def name(self, run: Run) -> str:
        clip, algorithm = clipping_of(run.trainer)
        if clip is None:
            return "gradient_clip_val"
        return f"gradient_clip_val={run.trainer.gradient_clip_val}, algorithm={algorithm}"

    @override
    def why_off(self, run: Run) -> str | None:
        return "not set" if clipping_of(run.trainer)[0] is None else None

    @override
    def why_not(self, run: Run) -> str | None:
        return None if run.all_swapped else "an optimizer was not swapped: Lightning clips as before"

    @override
    def apply(self, run: Run) -> None:
        self._name = self.name(run)
        trainer = run.trainer
        if clipping_of(trainer)[1] == "norm":
            self._norm_of = run.swapped[0]
        self._saved = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        trainer.gradient_clip_val = None  # Lightning's clipping refuses fused optimizers; ours runs instead

    @override
    def rows(self, run: Run) -> list[Row]:
        if self._norm_of is not None:
            detail = describe(run, "by norm inside the fused step (statistics pass + update, no host sync)",
                              "by norm inside the fused step (torch's clip_grad_norm_ before the update)")
            if self.log_grad_norm:
                detail += "; pre-clip norm logged as grad_norm"
        else:
            detail = describe(run, "by value inside the fused step (the update clamps the unscaled grads: no "
                              "extra launch, no host sync)",
                              "by value inside the fused step (torch's clip_grad_value_ before the update)")
        return [Row(self.kind, self._name, ON, detail + "; Trainer clipping off for the run")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        run.trainer.gradient_clip_val, run.trainer.gradient_clip_algorithm = self._saved

    @override
    def after_batch(self, run: Run) -> None:
        if not self.log_grad_norm or self._norm_of is None or not _log_step(run.trainer):
            return
        norm = self._norm_of.grad_norm
        if norm is not None:
            run.module.log("grad_norm", norm, on_step=True, on_epoch=False, logger=bool(run.trainer.loggers))


def _log_step(trainer: pl.Trainer) -> bool:
    """Whether the Trainer writes this step's logs (its ``log_every_n_steps`` cadence, as its
    logger connector decides it, read from public attributes; automatic optimization steps one
    optimizer a batch, so ``global_step`` after the step is the batch count it uses)."""
    every = trainer.log_every_n_steps
    if trainer.fast_dev_run:
        return True
    return bool(every) and (trainer.global_step % every == 0 or trainer.should_stop)


__all__ = ["Clipping", "OptimizerSwap", "clipping_of"]
