"""Module fusion inside a LightningModule: Linear/activation chains -> FusedMLP (through
``trainfuse.nn.fuse_mlps``), ``nn.BCEWithLogitsLoss`` -> ``trainfuse.losses.BCEWithLogitsLoss``,
and (``bn_silu=True``) a Sequential's BatchNorm2d then SiLU -> one op
(:func:`trainfuse.nn.conv_block.fuse_pairs`; undone at the end of the fit).

Both keep the Parameter objects, buffers and state_dict keys, so optimizers, checkpoints, wrap
policies and EMA copies made before stay valid. Modules with hooks or parametrizations (pruning,
weight_norm, spectral_norm) are left alone: the fused forward would not call the hooks, and a
parametrized weight is recomputed by its own forward. So are modules torch.compile compiled (a
``torch.compile``'d child, or the whole LightningModule given to ``trainer.fit`` compiled): their
compiled code calls the modules it wrapped, and dynamo would trace a fused forward's Triton launch.

The fused modules stay after the fit, on every path: a FusedMLP is an ``nn.Sequential`` with the
same children and a fused BCEWithLogitsLoss an ``nn.BCEWithLogitsLoss`` with the same state, and
each computes what the module it stands for computes (with torch's own layers where the kernels do
not run), so there is nothing the user's model would lack.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.nn.utils import parametrize
from typing_extensions import override

from trainfuse._runtime import compat
from trainfuse.clients import SKIPPED, SWAPPED, Row
from trainfuse.lightning import _compat
from trainfuse.lightning.changes.base import Change, Run, describe
from trainfuse.losses import BCEWithLogitsLoss
from trainfuse.nn import conv_block, fuse_mlps

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


def _walk(module: nn.Module, name: str = "", parent: nn.Module | None = None, attr: str = "",
          compiled: str | None = None, seen: set[int] | None = None
          ) -> Iterator[tuple[str, nn.Module, nn.Module | None, str, str | None]]:
    """(name, module, parent, attribute, compiled) for ``module`` and every module inside it, by the
    names of the user's model: a torch.compile wrapper adds no name, the module it wraps stands in
    its place. ``compiled``: the outermost torch.compile'd module it runs inside, or None. A module
    reached under several names is listed under each, its children once."""
    seen = set() if seen is None else seen
    inner = compat.compiled_original(module)
    if inner is not None:
        module, compiled = inner, name if compiled is None else compiled
    yield name, module, parent, attr, compiled
    if id(module) in seen:
        return
    seen.add(id(module))
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        yield from _walk(child, full, module, child_name, compiled, seen)


def why_compiled(compiled: str) -> str:
    """Why a module inside the torch.compile'd module named ``compiled`` keeps its own forward."""
    return (f"{compiled} is torch.compile'd: dynamo compiled it, its compiled code calls the modules it "
            "wrapped (a fused module swapped in would not run) and a recompile would trace a fused "
            "module's Triton launch")


def why_not_compiled_run(run: Run) -> str | None:
    """Why no module may be swapped when Lightning compiles the LightningModule, else None."""
    if not _compat.compiled_by_trainer(run.module):
        return None
    return ("the LightningModule is compiled (trainer.fit(torch.compile(model))): Lightning runs its forward "
            "and steps through dynamo, which would trace a fused module's Triton launch; the modules "
            "stay stock, compiled as given")


def _chains(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Sequential, str | None]]:
    """(parent, attribute, full name, Sequential, compiled) for every plain Sequential with a Linear
    child; ``compiled``: the torch.compile'd module it runs inside, or None."""
    return [(parent, attr, name, m, compiled) for name, m, parent, attr, compiled in _walk(model)
            if parent is not None and type(m) is nn.Sequential
            and any(isinstance(c, nn.Linear) for c in m.children())]


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

    @override
    def name(self, run: Run) -> str:
        return ", ".join(full for _, _, full, _, _ in _chains(run.module))

    @override
    def why_off(self, run: Run) -> str | None:
        if not _chains(run.module):
            return "no nn.Sequential of Linear + activation in the module"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        if run.strategy in ("fsdp", "fsdp2"):
            return f"{run.strategy} shards the layers' weights and gathers them from its own hooks"
        return why_not_compiled_run(run)

    @override
    def apply(self, run: Run) -> None:
        detail = describe(run, "FusedMLP: matmul + bias + activation a layer, one kernel",
                          "FusedMLP: on the torch path the Sequential's own layers run (same params, keys)")
        for parent, attr, full, seq, compiled in _chains(run.module):
            reason = _why_not_chain(seq) if compiled is None else why_compiled(compiled)
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

    @override
    def rows(self, run: Run) -> list[Row]:
        return self._rows


def _losses(model: nn.Module) -> list[tuple[str, nn.Module, str | None]]:
    """(name, module, compiled) for every ``nn.BCEWithLogitsLoss`` module, each once; ``compiled``: the
    torch.compile'd module it runs inside, or None."""
    found = {}
    for name, m, _, _, compiled in _walk(model):
        if type(m) is nn.BCEWithLogitsLoss:
            found.setdefault(id(m), (name, m, compiled))
    return list(found.values())


class LossFusion(Change):
    """Every ``nn.BCEWithLogitsLoss`` module -> trainfuse's BCEWithLogitsLoss (a subclass with the
    same constructor, buffers and state; only ``forward`` differs), in place."""

    kind = "loss"

    def __init__(self) -> None:
        self._rows: list[Row] = []

    @override
    def name(self, run: Run) -> str:
        return ", ".join(name for name, _, _ in _losses(run.module))

    @override
    def why_off(self, run: Run) -> str | None:
        return None if _losses(run.module) else "no nn.BCEWithLogitsLoss module"

    @override
    def why_not(self, run: Run) -> str | None:
        return why_not_compiled_run(run)

    @override
    def apply(self, run: Run) -> None:
        detail = describe(run, "BCEWithLogitsLoss: loss, reduction and grad in one pass",
                          "BCEWithLogitsLoss: on the torch path torch's binary_cross_entropy_with_logits")
        for name, m, compiled in _losses(run.module):
            reason = why_not_fusable(m) if compiled is None else why_compiled(compiled)
            if reason is not None:
                self._rows.append(Row(self.kind, name, SKIPPED, reason))
                continue
            m.__class__ = BCEWithLogitsLoss
            self._rows.append(Row(self.kind, name, SWAPPED, detail))

    @override
    def rows(self, run: Run) -> list[Row]:
        return self._rows


def _bn_silu_pairs(model: nn.Module) -> list[tuple[str, nn.Sequential, list[int], str | None]]:
    """(name, Sequential, positions, compiled) for every Sequential holding a BatchNorm2d then a
    SiLU (:func:`~trainfuse.nn.conv_block.fusable_pairs`), each once."""
    found = {}
    for name, m, _, _, compiled in _walk(model):
        if isinstance(m, nn.Sequential) and (positions := conv_block.fusable_pairs(m)):
            found.setdefault(id(m), (name, m, positions, compiled))
    return list(found.values())


class BatchNormSiLUFusion(Change):
    """Every BatchNorm2d followed by a SiLU in an ``nn.Sequential`` (torchvision's
    Conv2dNormActivation, a CNN's conv-norm-act stacks) -> one op, in place; undone at the end."""

    kind = "bn_silu"

    def __init__(self) -> None:
        self._rows: list[Row] = []
        self._taken: list[tuple[nn.Sequential, list[tuple[int, nn.Module]]]] = []

    @override
    def name(self, run: Run) -> str:
        return ", ".join(name or "the module" for name, _, _, _ in _bn_silu_pairs(run.module))

    @override
    def why_off(self, run: Run) -> str | None:
        return None if _bn_silu_pairs(run.module) else "no BatchNorm2d followed by SiLU in an nn.Sequential"

    @override
    def why_not(self, run: Run) -> str | None:
        if run.strategy in ("fsdp", "fsdp2"):
            return f"{run.strategy} shards the BatchNorms' weights and gathers them from its own hooks"
        return why_not_compiled_run(run)

    @override
    def apply(self, run: Run) -> None:
        detail = describe(run, "BatchNorm2d + SiLU: two launches forward, two backward, the "
                          "BatchNorm's output not kept",
                          "BatchNorm2d + SiLU: on the torch path torch's batch_norm and silu")
        for name, seq, positions, compiled in _bn_silu_pairs(run.module):
            where = name or "the module"
            pairs = [i for i in positions
                     if why_not_fusable(seq[i]) is None and why_not_fusable(seq[i + 1]) is None]
            reason = why_compiled(compiled) if compiled is not None else None
            if reason is None and not pairs:
                reason = why_not_fusable(seq[positions[0]]) or why_not_fusable(seq[positions[0] + 1])
            if reason is not None:
                self._rows.append(Row(self.kind, where, SKIPPED, reason))
                continue
            self._taken.append((seq, conv_block.fuse_pairs(seq, pairs)))
            self._rows.append(Row(self.kind, where, SWAPPED, f"{len(pairs)} pair(s), {detail}"))

    @override
    def rows(self, run: Run) -> list[Row]:
        return self._rows

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        for seq, taken in reversed(self._taken):
            conv_block.unfuse_pairs(seq, taken)
        self._taken = []


__all__ = ["BatchNormSiLUFusion", "LossFusion", "MLPFusion", "why_not_fusable"]
