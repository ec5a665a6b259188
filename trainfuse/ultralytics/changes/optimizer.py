"""ultralytics' optimizer -> its fused drop-in, and what a checkpoint saves of it.

ultralytics builds ``SGD``, ``Adam``, ``AdamW`` or ``MuSGD`` (what ``auto`` picks past 10,000
iterations) over its param groups; the change rebuilds it as the fused counterpart over the very
same group dicts and state (:func:`trainfuse.clients.swap_optimizer`: a resumed run's state comes
along), clipping at ultralytics' norm of 10 inside the step, and points the LR scheduler at it.
``NAdam``, ``RAdam``, ``Adamax`` and ``RMSprop`` stay stock, and the row says why. The fused
optimizer stays after training (it continues ultralytics' own); around a checkpoint load the stock
one comes back with the state reached, takes the checkpoint's, and is swapped again.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from trainfuse.amp import GradScaler
from trainfuse.clients import SWAPPED, Row, repoint_schedulers, swap_optimizer, why_not_swappable
from trainfuse.optim import FusedOptimizer, torch_state_dict
from trainfuse.ultralytics.changes.base import Change, Run

# ultralytics' optimizer_step clips the gradient norm at this value
CLIP_NORM = 10.0


def fused_optimizer(stock: torch.optim.Optimizer, max_grad_norm: float | None = CLIP_NORM
                    ) -> tuple[torch.optim.Optimizer | None, str]:
    """Rebuild ``stock`` (an optimizer ultralytics built) as its fused drop-in over the same groups.

    Args:
        stock: the optimizer; its param groups are reused with every key they carry, its state too.
        max_grad_norm: the global gradient norm the fused step clips to (None: no clipping).

    Returns:
        ``(fused optimizer, "")``, or ``(None, reason)`` when it stays stock
        (:func:`trainfuse.clients.why_not_swappable`: no fused counterpart, step hooks...).
    """
    reason = why_not_swappable(stock, kernels=False)
    if reason is not None:
        return None, reason
    return swap_optimizer(stock, max_grad_norm=max_grad_norm), ""


class OptimizerSwap(Change):
    """The trainer's optimizer -> its fused counterpart (module docstring)."""

    kind = "optimizer"

    def __init__(self) -> None:
        self._stock: torch.optim.Optimizer | None = None
        self._fused: FusedOptimizer | None = None

    @override
    def name(self, run: Run) -> str:
        return type(run.trainer.optimizer).__name__

    @override
    def why_not(self, run: Run) -> str | None:
        if isinstance(run.trainer.optimizer, FusedOptimizer):
            return None
        return why_not_swappable(run.trainer.optimizer, kernels=False)

    @override
    def apply(self, run: Run) -> None:
        trainer = run.trainer
        if isinstance(trainer.optimizer, FusedOptimizer):  # built fused already: nothing to swap
            self._fused = trainer.optimizer
            return
        self._stock = trainer.optimizer
        self._fused, _ = fused_optimizer(self._stock)
        self._repoint(trainer, self._stock, self._fused)

    @override
    def rows(self, run: Run) -> list[Row]:
        return [Row(self.kind, self.name(run), SWAPPED, f"{type(self._fused).__name__} over ultralytics' "
                    f"{len(self._fused.param_groups)} param groups, gradient norm clipped at {CLIP_NORM:g} "
                    "inside the step")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if not run.reloading or self._stock is None:
            return  # the fused optimizer continues ultralytics' own: it stays
        self._stock.load_state_dict(torch_state_dict(self._fused.state_dict()))
        self._repoint(run.trainer, self._fused, self._stock)

    @staticmethod
    def _repoint(trainer: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        trainer.optimizer = new
        scheduler = getattr(trainer, "scheduler", None)
        if scheduler is not None:
            repoint_schedulers([scheduler], old, new)


def fused_phase(optimizer: FusedOptimizer, scaler: Any) -> None:
    """The fused optimizer phase, eagerly: unscale, inf check, clip, step, EMA and scale update in
    two launches (``scaler.step_and_update``), or a scaler of another kind's (NPU) own two calls."""
    if isinstance(scaler, GradScaler):
        scaler.step_and_update(optimizer)
    else:
        scaler.step(optimizer)
        scaler.update()


class TorchLayoutOptimizer:
    """What ``BaseTrainer.save_model`` reads of the optimizer, its ``state_dict()``, in
    torch.optim's layout (:func:`trainfuse.optim.torch_state_dict`), so a checkpoint loads into
    stock ultralytics."""

    def __init__(self, optimizer: FusedOptimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return torch_state_dict(self.optimizer.state_dict())


__all__ = ["CLIP_NORM", "OptimizerSwap", "TorchLayoutOptimizer", "fused_optimizer", "fused_phase"]
