"""The detection loss without host syncs, and the report of how the training batches load.

**Loss**: :func:`criterion`'s fused loss for ``model.criterion`` (FusedE2ELoss for end-to-end
heads, YOLO26 and YOLOv10, FusedDetectionLoss for the others), the labels padded on the CPU by the
loader's workers (:mod:`trainfuse.ultralytics.loading`); ultralytics' own criterion comes back at
the end. Models of other classes keep their own loss, and the row says why.

**Augment**: the rows of what :class:`~trainfuse.ultralytics.loading.BatchLoading` decided when
ultralytics built the training dataset (before any change is made: its loader's workers start
with it).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from ultralytics.nn.tasks import DetectionModel

from trainfuse.clients import SWAPPED, Row
from trainfuse.ultralytics.changes.base import Change, Run
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss, takes_fused_e2e_loss
from trainfuse.ultralytics.loss import FusedDetectionLoss

FUSED_LOSSES = (FusedDetectionLoss, FusedE2ELoss)


def takes_fused_loss(model: torch.nn.Module) -> bool:
    """Whether a fused loss implements ``model``'s: a plain DetectionModel, end-to-end (YOLO26,
    YOLOv10: :class:`FusedE2ELoss`) or not (:class:`FusedDetectionLoss`)."""
    if type(model) is not DetectionModel:
        return False
    return takes_fused_e2e_loss(model) or getattr(model.model[-1], "one2one_cv2", None) is None


def criterion(model: torch.nn.Module) -> Any:
    """The detection loss the trainer installs on ``model``: the one place to switch it.
    :class:`~trainfuse.ultralytics.FusedE2ELoss` for end-to-end heads,
    :class:`~trainfuse.ultralytics.FusedDetectionLoss` for the others (:func:`takes_fused_loss`),
    else ultralytics' own ``model.init_criterion()``."""
    if takes_fused_e2e_loss(model):
        return FusedE2ELoss(model)
    return FusedDetectionLoss(model) if takes_fused_loss(model) else model.init_criterion()


class LossSwap(Change):
    """``model.criterion`` -> its fused counterpart (module docstring)."""

    kind = "loss"

    def __init__(self) -> None:
        self._old: Any = None

    @override
    def name(self, run: Run) -> str:
        return type(run.model).__name__

    @override
    def why_not(self, run: Run) -> str | None:
        if takes_fused_loss(run.model):
            return None
        return (f"{type(run.model).__name__} keeps ultralytics' own loss: the fused losses implement "
                "v8DetectionLoss and E2ELoss of plain detection models")

    @override
    def apply(self, run: Run) -> None:
        model = run.model
        current = getattr(model, "criterion", None)
        if isinstance(current, FUSED_LOSSES):  # made again after a checkpoint load: it carries on
            return
        self._old, model.criterion = current, criterion(model)
        if isinstance(model.criterion, FusedE2ELoss) and current is not None:
            model.criterion.copy_schedule(current)  # a resume set ultralytics' E2ELoss to its epoch

    @override
    def rows(self, run: Run) -> list[Row]:
        return [Row(self.kind, self.name(run), SWAPPED, f"{type(run.model.criterion).__name__}, labels "
                    "padded on the CPU (no host sync in the loss)")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if not run.reloading:  # (around a load, the fused loss and its schedule carry on)
            run.model.criterion = self._old


class Augment(Change):
    """What the training batches' loading decided (module docstring)."""

    kind = "augment"

    @override
    def why_off(self, run: Run) -> str | None:
        return None if run.loading.rows else "no training dataset was built"

    @override
    def rows(self, run: Run) -> list[Row]:
        return list(run.loading.rows)


__all__ = ["FUSED_LOSSES", "Augment", "LossSwap", "criterion", "takes_fused_loss"]
