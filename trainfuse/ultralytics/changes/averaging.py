"""ultralytics' ModelEMA -> :class:`~trainfuse.optim.FusedEMA` (its weights, count and
``enabled``), folded into the fused optimizer's update kernel where there is one: ``ema.update``
then counts one update and launches nothing. The FusedEMA stays after training (it saves as the
ModelEMA does); around a checkpoint load it is detached from the optimizer, ultralytics makes a
fresh ModelEMA from the checkpoint, and the change is made again."""

from __future__ import annotations

from typing_extensions import override
from ultralytics.utils.torch_utils import ModelEMA

from trainfuse.clients import SWAPPED, Row
from trainfuse.optim import FusedEMA
from trainfuse.ultralytics.changes.base import Change, Run


class EMASwap(Change):
    """The trainer's ModelEMA -> a FusedEMA, attached to the fused optimizer (module docstring)."""

    kind = "ema"

    @override
    def name(self, run: Run) -> str:
        return type(run.trainer.ema).__name__

    @override
    def why_off(self, run: Run) -> str | None:
        ema = getattr(run.trainer, "ema", None)
        if ema is None:
            return "no EMA"
        if not isinstance(ema, (ModelEMA, FusedEMA)):
            return f"{type(ema).__name__} is not ultralytics' ModelEMA: it stays"
        return None

    @override
    def apply(self, run: Run) -> None:
        old = run.trainer.ema
        if isinstance(old, ModelEMA):
            ema = FusedEMA(run.trainer.model, updates=old.updates)
            ema.ema.load_state_dict(old.ema.state_dict())
            ema.enabled = old.enabled
            run.trainer.ema = old = ema
        if run.fused is not None:
            run.fused.attach_ema(old)

    @override
    def rows(self, run: Run) -> list[Row]:
        where = ("inside the fused optimizer's update kernel" if run.fused is not None
                 else "one launch after the stock optimizer's step")
        return [Row(self.kind, "ModelEMA", SWAPPED, f"FusedEMA: every param's and buffer's average {where}")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if run.reloading and run.fused is not None:
            run.fused.attach_ema(None)


__all__ = ["EMASwap"]
