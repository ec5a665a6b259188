"""The EMA of the weights, kept inside the optimizer step, with Lightning's EMAWeightAveraging
semantics: the same schedule, validation inside the fit on the average, the average in the module
after the fit and in the checkpoints' ``state_dict``."""

from __future__ import annotations

from typing_extensions import override

from trainfuse.clients import ON, Row
from trainfuse.lightning.changes.base import Change, Run, describe
from trainfuse.lightning.weight_ema import WeightEMA

_SEMANTICS = ("validation runs on it; the module holds it after fit and checkpoints save it as state_dict "
              "(live weights in current_model_state), as EMAWeightAveraging")


class EMA(Change):
    """An EMA of the float params and buffers (:class:`~trainfuse.lightning.weight_ema.WeightEMA`),
    folded into the one swapped optimizer's step, else updated after each step. Made before the
    casts: it averages the float32 weights (the masters, once they exist).

    Restore: after a fit that ended, the average goes into the module, as EMAWeightAveraging's
    ``on_train_end`` does; after a failure the module keeps the live weights. Either way the
    average stays here for the checkpoints saved afterwards (ModelCheckpoint's last one at train
    end, or on an exception), with the live weights the fit ended with.

    Args:
        decay: the EMA decay, or None for no EMA.
        resumed: the average and update count of the checkpoint the fit resumes from, if any.
    """

    kind = "ema"

    def __init__(self, decay: float | None, resumed: tuple[dict, int] | None = None) -> None:
        self.decay = decay
        self.resumed = resumed
        self.ema: WeightEMA | None = None
        self._after_step = False  # no optimizer to fold it into: updated at each batch end
        self._last_step = 0
        self._displaced: dict = {}  # the live values the average replaced at train end

    @override
    def name(self, run: Run) -> str:
        return "-" if self.decay is None else f"decay={self.decay}"

    @override
    def why_off(self, run: Run) -> str | None:
        return "ema_decay=None" if self.decay is None else None

    @override
    def why_not(self, run: Run) -> str | None:
        if run.strategy in ("fsdp", "fsdp2"):
            return (f"{run.strategy}: Lightning's sharded checkpoints hold the model and optimizer states "
                    "only, so a sharded average (and the live weights beside it) has no place in them; "
                    "FusedEMA over the sharded model saves with torch.distributed.checkpoint")
        return None

    @override
    def apply(self, run: Run) -> None:
        self.ema = WeightEMA(run.module, self.decay)
        if self.resumed is not None:
            self.ema.load(*self.resumed)
        opt = run.sole_optimizer
        if opt is not None:
            opt.attach_ema(self.ema.fused)
        else:
            self._after_step = True

    @override
    def rows(self, run: Run) -> list[Row]:
        n = len(self.ema.pairs)
        if self._after_step:
            how = describe(run, f"{n} tensors averaged in one launch after each optimizer step",
                           f"{n} tensors averaged after each optimizer step (torch._foreach_lerp_)")
            how += " (no one swapped optimizer to fold it into)"
        else:
            how = describe(run, f"{n} tensors averaged inside the optimizer step's update launch",
                           f"{n} tensors averaged inside the optimizer step (torch._foreach_lerp_ after the "
                           "update)")
        return [Row(self.kind, self.name(run), ON, f"{how}; {_SEMANTICS}")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if not failed:
            self._displaced = self.ema.copy_to(run.module)

    def live_values(self) -> dict:
        """state_dict key -> the live value a checkpoint saves where the module holds the average
        instead: while validation runs on it, and after the fit ended."""
        return {**self.ema.live_values(), **self._displaced}

    @override
    def after_batch(self, run: Run) -> None:
        if self._after_step and run.trainer.global_step > self._last_step:
            self.ema.update()
            self._last_step = run.trainer.global_step


class EvaluateOnEMA(Change):
    """Validation inside the fit runs on the EMA: swapped in at a validation epoch's start, the
    live weights back at its end. Last in the list, so that its restore (the live weights back,
    when validation raised) runs first, while the weights are still what the swap found (16-bit
    under casts, graphs installed). No row of its own: the EMA's row says it."""

    kind = "ema"

    def __init__(self, ema: EMA) -> None:
        self.ema = ema

    @override
    def validation_starts(self, run: Run) -> None:
        if self.ema.ema is not None:  # None: the EMA was skipped (its row says why)
            self.ema.ema.swap_in(run.module)

    @override
    def validation_ends(self, run: Run) -> None:
        if self.ema.ema is not None:
            self.ema.ema.swap_out(run.module)

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if self.ema.ema is not None:
            self.ema.ema.swap_out(run.module)


__all__ = ["EMA", "EvaluateOnEMA"]
