"""Mixed precision under FusedTraining: 16-bit weights with float32 masters in the fused
optimizer (cast fusion), and trainfuse's GradScaler in place of Lightning's under 16-mixed."""

from __future__ import annotations

import torch
from typing_extensions import override

from trainfuse.clients import ON, SWAPPED, CastState, Row, fused_scaler, hand_back_scaler
from trainfuse.lightning import _compat
from trainfuse.lightning.changes.base import Change, Run, describe
from trainfuse.lightning.changes.ddp import why_not_flat
from trainfuse.lightning.changes.scope import PRECISIONS


class Casts(Change):
    """Under 16-mixed and bf16-mixed, the float32 params become 16-bit with their float32 masters
    in the one swapped optimizer (:func:`trainfuse.amp.fuse_casts`): its step writes the 16-bit
    weights the forward reads, so autocast no longer casts every weight at each use. Undone on
    every path: the params are float32 again, with their masters' values."""

    kind = "casts"

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.state: CastState | None = None

    @override
    def name(self, run: Run) -> str:
        return run.precision

    @override
    def why_off(self, run: Run) -> str | None:
        if PRECISIONS[run.precision] is None:
            return f"{run.precision}: nothing is cast"
        if not self.enabled:
            return "fuse_casts=False: autocast casts every weight at each use"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        if run.strategy in ("fsdp", "fsdp2"):
            return "FSDP keeps float32 shards and casts them with its own param_dtype"
        if run.strategy == "ddp" and why_not_flat(run) is not None:
            return ("DDP's own reducer stays (" + why_not_flat(run) + "), and its gradient buckets keep the "
                    "float32 dtype")
        if run.strategy not in ("single", "ddp"):
            return f"{run.strategy} strategy: FusedTraining casts single-device and DDP runs"
        if not run.kernels:
            return "torch path: only the optimizer kernel writes the 16-bit weights"
        if run.sole_optimizer is None:
            return "needs one swapped optimizer to hold the float32 masters"
        averaging = _compat.weight_averaging_callbacks(run.trainer.callbacks)
        if averaging:
            return (f"{type(averaging[0]).__name__} copies its average into the weights at train end, which "
                    "the float32 masters would overwrite")
        return None

    @override
    def apply(self, run: Run) -> None:
        self.state = CastState(run.module, run.sole_optimizer, PRECISIONS[run.precision])

    @override
    def rows(self, run: Run) -> list[Row]:
        dtype = str(self.state.dtype).removeprefix("torch.")
        return [Row(self.kind, run.precision, ON, f"{len(self.state.params)} params {dtype} with float32 "
                    "masters; the step writes the 16-bit weights the forward reads (norms and embeddings "
                    "stay float32)")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        self.state.restore()

    def float32_weights(self) -> dict[str, torch.Tensor]:
        """state_dict key -> float32 value of every cast param (what a checkpoint saves)."""
        return self.state.float32_weights() if self.state is not None else {}


class Scaler(Change):
    """Under 16-mixed, the precision plugin's ``torch.amp.GradScaler`` -> trainfuse's (same
    settings and state), whose inf check is the fused optimizer's statistics pass. Lightning's
    scaler comes back at the end, with the state the run reached."""

    kind = "scaler"

    def __init__(self) -> None:
        self._old: torch.amp.GradScaler | None = None

    @override
    def name(self, run: Run) -> str:
        return "GradScaler"

    @override
    def why_off(self, run: Run) -> str | None:
        return None if run.swapped else "no optimizer was swapped: Lightning's scaler steps the user's"

    @override
    def why_not(self, run: Run) -> str | None:
        old = getattr(run.trainer.precision_plugin, "scaler", None)
        if type(old) is not torch.amp.GradScaler:
            return (f"the precision plugin's scaler is {type(old).__name__}, not torch.amp.GradScaler: it "
                    "stays")
        return None

    @override
    def apply(self, run: Run) -> None:
        plugin = run.trainer.precision_plugin
        self._old = plugin.scaler
        plugin.scaler = fused_scaler(self._old, str(getattr(plugin, "device", run.device.type)))

    @override
    def rows(self, run: Run) -> list[Row]:
        return [Row(self.kind, "GradScaler", SWAPPED, describe(
            run, "trainfuse.amp.GradScaler: the inf check is the step's statistics pass; unscale and inf "
            "skip run in the step, no host sync",
            "trainfuse.amp.GradScaler: on the torch path it runs torch's GradScaler check and step"))]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        plugin = run.trainer.precision_plugin
        plugin.scaler = hand_back_scaler(plugin.scaler, self._old)


__all__ = ["Casts", "Scaler"]
