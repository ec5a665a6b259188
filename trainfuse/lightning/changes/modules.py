"""Module fusion inside a LightningModule: Linear/activation chains -> FusedMLP (through
``trainfuse.nn.fuse_mlps``) and ``nn.BCEWithLogitsLoss`` -> ``trainfuse.losses.BCEWithLogitsLoss``.

Both keep the Parameter objects, buffers and state_dict keys, so optimizers, checkpoints, wrap
policies and EMA copies made before stay valid. Modules with hooks or parametrizations (pruning,
weight_norm, spectral_norm) are left alone: the fused forward would not call the hooks, and a
parametrized weight is recomputed by its own forward.

The fused modules stay after the fit, on every path: a FusedMLP is an ``nn.Sequential`` with the
same children and a fused BCEWithLogitsLoss an ``nn.BCEWithLogitsLoss`` with the same state, and
each computes what the module it stands for computes (with torch's own layers where the kernels do
not run), so there is nothing the user's model would lack.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from trainfuse._runtime import compat
from trainfuse.clients import SKIPPED, SWAPPED, Row
from trainfuse.lightning.changes.base import Change, Run, describe
from trainfuse.losses import BCEWithLogitsLoss
from trainfuse.nn import fuse_mlps

_CHAIN_LEAVES = (nn.Linear, nn.ReLU, nn.GELU, nn.SiLU, nn.Identity, nn.Dropout)


def why_not_fusable(module: nn.Module) -> str | None:
    """Why ``module`` (or a module inside it) must keep its own forward, or None."""
    for name, m in module.named_modules():
        where = f"child {name}" if name else "the module"
        hooks = compat.module_hooks(m)
        if hooks:
            kind = hooks[0].replace("_", " ")
            return (f"{where} has {kind} hooks (pruning and weight_norm use them), which the fused forward "
                    "skips")
        if parametrize.is_parametrized(m):
            return f"{where} is parametrized (torch.nn.utils.parametrize); its forward computes its weight"
    return None


def _chains(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Sequential]]:
    """(parent, attribute, full name, Sequential) for every plain Sequential with a Linear child."""
    out = []
    for name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is nn.Sequential and any(isinstance(m, nn.Linear) for m in child.children()):
                out.append((parent, child_name, f"{name}.{child_name}" if name else child_name, child))
    return out


def _why_not_chain(seq: nn.Sequential) -> str | None:
    reason = why_not_fusable(seq)
    if reason is not None:
        return reason
    for child_name, child in seq.named_children():
        if type(child) not in _CHAIN_LEAVES:
            return f"child {child_name} ({type(child).__name__}) is not Linear, an activation or Dropout"
    return None


class MLPFusion(Change):
    """Every plain ``nn.Sequential`` of Linear, activation and Dropout layers -> FusedMLP, in place;
    one row per chain found."""

    kind = "mlp"

    def __init__(self) -> None:
        self._rows: list[Row] = []

    def why_off(self, run: Run) -> str | None:
        if not _chains(run.module):
            return "no nn.Sequential of Linear + activation in the module"
        return None

    def why_not(self, run: Run) -> str | None:
        if run.strategy in ("fsdp", "fsdp2"):
            return f"{run.strategy} shards the layers' weights and gathers them from its own hooks"
        return None

    def apply(self, run: Run) -> None:
        detail = describe(run, "FusedMLP: matmul + bias + activation a layer, one kernel",
                          "FusedMLP: on the torch path the Sequential's own layers run (same params, keys)")
        for parent, attr, full, seq in _chains(run.module):
            reason = _why_not_chain(seq)
            if reason is None:
                # fuse_mlps acts on the children of the module it is given: a one-child box limits it
                # to this Sequential
                box = nn.Module()
                box.add_module("chain", seq)
                result = fuse_mlps(box)
                if result.swapped:
                    setattr(parent, attr, box.chain)
                    self._rows.append(Row(self.kind, full, SWAPPED, detail))
                    continue
                reason = result.skipped[0][1] if result.skipped else "fuse_mlps did not take it"
            self._rows.append(Row(self.kind, full, SKIPPED, reason))

    def rows(self, run: Run) -> list[Row]:
        return self._rows


def _losses(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.BCEWithLogitsLoss]


class LossFusion(Change):
    """Every ``nn.BCEWithLogitsLoss`` module -> trainfuse's BCEWithLogitsLoss (a subclass with the
    same constructor, buffers and state; only ``forward`` differs), in place."""

    kind = "loss"

    def __init__(self) -> None:
        self._rows: list[Row] = []

    def why_off(self, run: Run) -> str | None:
        return None if _losses(run.module) else "no nn.BCEWithLogitsLoss module"

    def apply(self, run: Run) -> None:
        detail = describe(run, "BCEWithLogitsLoss: loss, reduction and grad in one pass",
                          "BCEWithLogitsLoss: on the torch path torch's binary_cross_entropy_with_logits")
        for name, m in _losses(run.module):
            reason = why_not_fusable(m)
            if reason is not None:
                self._rows.append(Row(self.kind, name, SKIPPED, reason))
                continue
            m.__class__ = BCEWithLogitsLoss
            self._rows.append(Row(self.kind, name, SWAPPED, detail))

    def rows(self, run: Run) -> list[Row]:
        return self._rows


__all__ = ["LossFusion", "MLPFusion", "why_not_fusable"]
