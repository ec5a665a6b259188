"""Module fusion inside a LightningModule: Linear/activation chains -> FusedMLP (through
``trainfuse.nn.fuse_mlps``) and ``nn.BCEWithLogitsLoss`` -> ``trainfuse.losses.BCEWithLogitsLoss``.

Both keep the Parameter objects, buffers and state_dict keys, so optimizers, checkpoints, wrap
policies and EMA copies made before stay valid. Modules with hooks or parametrizations (pruning,
weight_norm, spectral_norm) are left alone: the fused forward would not call the hooks, and a
parametrized weight is recomputed by its own forward.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from trainfuse.lightning.report import SKIPPED, SWAPPED, Report
from trainfuse.losses import BCEWithLogitsLoss
from trainfuse.nn import fuse_mlps

_CHAIN_LEAVES = (nn.Linear, nn.ReLU, nn.GELU, nn.SiLU, nn.Identity, nn.Dropout)


def why_not_fusable(module: nn.Module) -> str | None:
    """Why ``module`` (or a module inside it) must keep its own forward, or None."""
    for name, m in module.named_modules():
        where = f"child {name}" if name else "the module"
        hooks = [h for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                 if getattr(m, h, None)]
        if hooks:
            kind = hooks[0].strip("_").replace("_", " ")
            return f"{where} has {kind} (pruning and weight_norm use them), which the fused forward skips"
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


def fuse_chains(model: nn.Module, report: Report) -> int:
    """Swap every eligible Linear/activation Sequential of ``model`` for a FusedMLP in place;
    one report row per candidate. Returns the number swapped."""
    swapped = 0
    for parent, attr, full, seq in _chains(model):
        reason = why_not_fusable(seq)
        if reason is None:
            for child_name, child in seq.named_children():
                if type(child) not in _CHAIN_LEAVES:
                    reason = (f"child {child_name} ({type(child).__name__}) is not Linear, an activation or "
                              "Dropout")
                    break
        if reason is None:
            # fuse_mlps acts on the children of the module it is given: a one-child box limits it
            # to this Sequential
            box = nn.Module()
            box.add_module("chain", seq)
            result = fuse_mlps(box)
            if result.swapped:
                setattr(parent, attr, box.chain)
                report.add("mlp", full, SWAPPED, "FusedMLP: matmul + bias + activation a layer, one kernel")
                swapped += 1
                continue
            reason = result.skipped[0][1] if result.skipped else "fuse_mlps did not take it"
        report.add("mlp", full, SKIPPED, reason)
    return swapped


def fuse_losses(model: nn.Module, report: Report) -> int:
    """Make every ``nn.BCEWithLogitsLoss`` module of ``model`` a trainfuse BCEWithLogitsLoss in
    place (a subclass with the same constructor, buffers and state; only ``forward`` differs).
    Returns the number swapped."""
    swapped = 0
    for name, m in model.named_modules():
        if type(m) is not nn.BCEWithLogitsLoss:
            continue
        reason = why_not_fusable(m)
        if reason is not None:
            report.add("loss", name, SKIPPED, reason)
            continue
        m.__class__ = BCEWithLogitsLoss
        report.add("loss", name, SWAPPED, "BCEWithLogitsLoss: loss, reduction and grad in one pass")
        swapped += 1
    return swapped


__all__ = ["fuse_chains", "fuse_losses", "why_not_fusable"]
