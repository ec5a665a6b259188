"""The state of fused casts in one model: which params :func:`trainfuse.amp.fuse_casts` made
16-bit, their float32 values, and the way back to float32."""

from __future__ import annotations

import torch
from torch import nn

from trainfuse.amp import fuse_casts
from trainfuse.optim import MASTER_KEY, FusedOptimizer


class CastState:
    """Casts ``module``'s float32 params to ``dtype`` with float32 masters in ``optimizer``.

    Params the optimizer owns have their float32 master in its state; the others (frozen params)
    keep their float32 tensor here, since nothing updates them.

    Args:
        module: the model.
        optimizer: the fused optimizer holding (some of) its params.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
    """

    def __init__(self, module: nn.Module, optimizer: FusedOptimizer, dtype: torch.dtype):
        before = {id(p): (p, p.data) for p in module.parameters() if p.dtype == torch.float32}
        fuse_casts(module, optimizer, dtype)
        self.optimizer = optimizer
        self.dtype = dtype
        self.params = [p for p, _ in before.values() if p.dtype == dtype]
        self._frozen = {id(p): data for p, data in before.values()
                        if p.dtype == dtype and MASTER_KEY not in optimizer.state.get(p, {})}
        self.names = {name: p for name, p in module.named_parameters(remove_duplicate=False)
                      if id(p) in before and p.dtype == dtype}

    def float32_of(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 value of a cast param: its master, or its kept float32 tensor."""
        master = self.optimizer.state.get(p, {}).get(MASTER_KEY)
        return master if master is not None else self._frozen[id(p)]

    def float32_weights(self) -> dict[str, torch.Tensor]:
        """state_dict key -> float32 value, for every cast param (copies)."""
        return {k: self.float32_of(p).detach().clone() for k, p in self.names.items()}

    @torch.no_grad()
    def restore(self) -> None:
        """Make the cast params float32 again with their float32 values, on the device each param
        is on now (a framework may have moved the module and the optimizer state meanwhile)."""
        for p in self.params:
            p.grad = None
            p.data = self.float32_of(p).detach().to(device=p.device, copy=True)

    @torch.no_grad()
    def restore_from_weights(self) -> None:
        """Make the cast params float32 again from their current 16-bit values (what a
        ``load_state_dict`` into the 16-bit model just wrote, newer than the masters)."""
        for p in self.params:
            p.grad = None
            p.data = p.data.float()


__all__ = ["CastState"]
