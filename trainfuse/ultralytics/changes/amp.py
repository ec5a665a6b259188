"""Mixed precision: trainfuse's GradScaler for torch's, and 16-bit weights with float32 masters.

**Scaler**: :class:`trainfuse.amp.GradScaler` is torch's with the inf/NaN check run by the fused
optimizer's statistics pass, and ``step_and_update`` in two launches (same settings and state).

**Casts** (AMP on CUDA, one GPU, a fused optimizer): under ultralytics' AMP every forward casts
each conv weight to float16 (one launch each) and the backward casts each weight grad back to
float32 (another): about 120 launches an iteration on yolov5n, some 4 ms of a host-bound 45 ms
iteration. With :func:`trainfuse.amp.fuse_casts` the weights *are* float16 (bfloat16 under
``amp="bf16"``), their float32 masters live in the optimizer's state and its update writes both,
so no cast runs. BatchNorm params stay float32, as autocast keeps them.

What differs from stock, on purpose: the grads of the cast weights are 16-bit, so the
``nbs / batch`` accumulated backward passes add in 16 bits (stock adds them in float32). GradScaler
sees the same overflows (the conv backward makes 16-bit grads in both), and the update itself runs
in float32 on the masters. Checkpoints stay stock: the optimizer state is saved in torch.optim's
layout (no masters; the EMA, which ultralytics saves as the model, is float32), and a resume makes
the masters again from the float32 weights ultralytics loads.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from trainfuse.amp import GradScaler
from trainfuse.clients import ON, CastState, Row, fused_scaler, hand_back_scaler
from trainfuse.ultralytics.changes.base import Change, Run


class Scaler(Change):
    """torch's GradScaler -> trainfuse's (same settings and state); torch's comes back with the
    state reached around a checkpoint load (ultralytics loads the saved scaler into it)."""

    kind = "scaler"

    def __init__(self) -> None:
        self._old: torch.amp.GradScaler | None = None

    @override
    def name(self, run: Run) -> str:
        return type(run.trainer.scaler).__name__

    @override
    def why_off(self, run: Run) -> str | None:
        if isinstance(run.trainer.scaler, GradScaler):
            return "already trainfuse's GradScaler"
        if type(run.trainer.scaler) is not torch.amp.GradScaler:
            return f"{type(run.trainer.scaler).__name__} is not torch's GradScaler: it stays"
        return None

    @override
    def apply(self, run: Run) -> None:
        trainer = run.trainer
        # the device string ultralytics gives its own scaler
        device = "xpu" if run.device.type == "xpu" else "cuda"
        self._old, trainer.scaler = trainer.scaler, fused_scaler(trainer.scaler, device)

    @override
    def rows(self, run: Run) -> list[Row]:
        state = "enabled" if run.trainer.scaler.is_enabled() else "disabled (AMP off)"
        return [Row(self.kind, "GradScaler", ON, f"trainfuse's GradScaler ({state}): the inf check inside "
                    "the fused optimizer's statistics pass, step and scale update in two launches")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if run.reloading:
            run.trainer.scaler = hand_back_scaler(run.trainer.scaler, self._old)


def cast_dtype(run: Run) -> torch.dtype | None:
    """The 16-bit dtype the trainer's autocast runs in, or None where nothing is cast (AMP off, no
    CUDA device, or an optimizer that stayed stock)."""
    trainer = run.trainer
    if not getattr(trainer, "amp", False) or run.device.type != "cuda" or run.fused is None:
        return None
    return torch.bfloat16 if trainer.args.amp == "bf16" else torch.float16


class Casts(Change):
    """16-bit weights with float32 masters in the fused optimizer (module docstring); float32 again
    at the end (from the masters) and around a checkpoint load (from the weights ultralytics has
    just loaded into the 16-bit model, newer than the masters)."""

    kind = "casts"

    def __init__(self, on: bool) -> None:
        self.on = on
        self.state: CastState | None = None

    @override
    def name(self, run: Run) -> str:
        dtype = cast_dtype(run)
        return "weights" if dtype is None else str(dtype).removeprefix("torch.")

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.on:
            return "fuse_casts=False"
        if cast_dtype(run) is None:
            return "weights stay float32: no AMP on CUDA with a fused optimizer"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        if run.trainer.world_size > 1:
            return ("weights stay float32 under DDP: the gradients are all-reduced in float32, as stock DDP "
                    "reduces them")
        return None

    @override
    def apply(self, run: Run) -> None:
        self.state = CastState(run.model, run.fused, cast_dtype(run))

    @override
    def rows(self, run: Run) -> list[Row]:
        dtype = str(self.state.dtype).removeprefix("torch.")
        return [Row(self.kind, dtype, ON, f"{len(self.state.params)} weights {dtype} with float32 masters in "
                    "the optimizer: autocast casts no weight (BatchNorm stays float32)")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if run.reloading:
            self.state.restore_from_weights()
        else:
            self.state.restore()
        self.state = None


__all__ = ["Casts", "Scaler", "cast_dtype"]
