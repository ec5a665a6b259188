"""Mixed precision under FusedTraining: which precisions it takes, cast fusion with float32
masters, and trainfuse's GradScaler in place of Lightning's under 16-mixed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainfuse.amp import GradScaler, fuse_casts
from trainfuse.lightning.checkpoint import MASTER_KEY

# Trainer(precision=...) values FusedTraining takes -> the 16-bit dtype of the autocast (None: none)
PRECISIONS: dict[str, torch.dtype | None] = {"32-true": None, "16-mixed": torch.float16,
                                             "bf16-mixed": torch.bfloat16}


def precision_of(trainer: Any) -> str:
    """The Trainer's precision as Lightning names it (``"32-true"``, ``"bf16-mixed"``...)."""
    return str(trainer.precision)


class CastState:
    """The params fuse_casts turned 16-bit, and their float32 values.

    Params the optimizer owns have a float32 master in its state; the others (frozen params) keep
    their float32 tensor here, since they are not updated.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype):
        before = {id(p): (p, p.data) for p in module.parameters() if p.dtype == torch.float32}
        fuse_casts(module, optimizer, dtype)
        self.optimizer = optimizer
        self.cast = [(p, data) for p, data in before.values() if p.dtype != torch.float32]
        self.names = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in before and p.dtype != torch.float32:
                self.names[name] = p

    def float32_of(self, p: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
        master = self.optimizer.state.get(p, {}).get(MASTER_KEY)
        return master if master is not None else original

    def float32_weights(self) -> dict[str, torch.Tensor]:
        """state_dict key -> float32 value, for every cast param (copies)."""
        original = {id(p): data for p, data in self.cast}
        return {k: self.float32_of(p, original[id(p)]).detach().clone() for k, p in self.names.items()}

    @torch.no_grad()
    def restore(self) -> None:
        """Make the cast params float32 again, with their float32 values, on the device the
        params are on now (after fit: Lightning's teardown has already moved the module and the
        optimizer state to the CPU, but not the float32 tensors of params outside the optimizer)."""
        for p, data in self.cast:
            p.grad = None
            p.data = self.float32_of(p, data).detach().to(device=p.device, copy=True)


def swap_scaler(plugin: Any) -> Any | None:
    """Give a 16-mixed precision plugin trainfuse's GradScaler (its inf check is the fused
    optimizer's statistics pass), with the old scaler's state. Returns the old scaler, or None
    when there is none or it is not torch's own class (a user's scaler stays)."""
    old = getattr(plugin, "scaler", None)
    if old is None or type(old) is not torch.amp.GradScaler:
        return None
    new = GradScaler(device=str(getattr(plugin, "device", "cuda")), enabled=old.is_enabled())
    new.load_state_dict(old.state_dict())
    plugin.scaler = new
    return old


def restore_scaler(plugin: Any, old: Any) -> None:
    """Put the scaler :func:`swap_scaler` replaced back, with the state it reached."""
    if old.is_enabled():
        old.load_state_dict(plugin.scaler.state_dict())
    plugin.scaler = old


__all__ = ["PRECISIONS", "CastState", "precision_of", "restore_scaler", "swap_scaler"]
