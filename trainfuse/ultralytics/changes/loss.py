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
from ultralytics.nn.modules.head import Pose26, Segment26
from ultralytics.nn.tasks import ClassificationModel, DetectionModel, OBBModel, PoseModel, SegmentationModel

from trainfuse.clients import SWAPPED, Row
from trainfuse.ultralytics.changes.base import Change, Run
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss, takes_fused_e2e_loss
from trainfuse.ultralytics.loss import FusedDetectionLoss
from trainfuse.ultralytics.obb_loss import FusedE2EOBBLoss, FusedOBBLoss
from trainfuse.ultralytics.pose26_loss import FusedE2EPose26Loss, FusedPose26Loss
from trainfuse.ultralytics.pose_loss import FusedPoseLoss
from trainfuse.ultralytics.segment26_loss import FusedE2ESegment26Loss, FusedSegment26Loss
from trainfuse.ultralytics.segment_loss import FusedSegmentationLoss

FUSED_LOSSES = (FusedDetectionLoss, FusedE2ELoss, FusedOBBLoss)  # (and their subclasses: pose, segment)


def fused_loss_class(model: torch.nn.Module) -> type | None:
    """The fused loss that implements ``model``'s, or None: a plain DetectionModel's
    (:class:`FusedE2ELoss` for end-to-end heads, YOLO26 and YOLOv10, else
    :class:`FusedDetectionLoss`); a PoseModel's (:class:`FusedPoseLoss` for ``v8PoseLoss``; for
    YOLO26's ``Pose26`` head :class:`FusedE2EPose26Loss`, or FusedPose26Loss without its one-to-one
    branch); an OBBModel's (:class:`FusedOBBLoss` for ``v8OBBLoss``, with or without DFL;
    :class:`FusedE2EOBBLoss` for YOLO26's end-to-end head); a SegmentationModel's
    (:class:`FusedSegmentationLoss` for ``v8SegmentationLoss``; for YOLO26's ``Segment26`` head
    :class:`FusedE2ESegment26Loss`, or FusedSegment26Loss without its one-to-one branch). An
    end-to-end head of the v8 pose or segmentation losses keeps ultralytics' own."""
    head = model.model[-1] if hasattr(model, "model") else None
    e2e = getattr(head, "one2one_cv2", None) is not None
    kind = type(model)
    if kind is DetectionModel:
        return FusedE2ELoss if takes_fused_e2e_loss(model) else None if e2e else FusedDetectionLoss
    if kind is PoseModel:
        if isinstance(head, Pose26):
            return FusedE2EPose26Loss if e2e else FusedPose26Loss
        return None if e2e else FusedPoseLoss
    if kind is OBBModel:
        return FusedE2EOBBLoss if e2e else FusedOBBLoss
    if kind is SegmentationModel:
        if isinstance(head, Segment26):
            return FusedE2ESegment26Loss if e2e else FusedSegment26Loss
        return None if e2e else FusedSegmentationLoss
    return None


def takes_fused_loss(model: torch.nn.Module) -> bool:
    """Whether a fused loss implements ``model``'s (:func:`fused_loss_class`)."""
    return fused_loss_class(model) is not None


def criterion(model: torch.nn.Module) -> Any:
    """The loss the trainer installs on ``model``: the one place to switch it. Its fused loss
    (:func:`fused_loss_class`), else ultralytics' own ``model.init_criterion()``."""
    made = fused_loss_class(model)
    return made(model) if made is not None else model.init_criterion()


class LossSwap(Change):
    """``model.criterion`` -> its fused counterpart (module docstring)."""

    kind = "loss"

    def __init__(self) -> None:
        self._old: Any = None

    @override
    def name(self, run: Run) -> str:
        return type(run.model).__name__

    @override
    def why_off(self, run: Run) -> str | None:
        if run.options.fused_loss:
            return None
        made = fused_loss_class(run.model)
        return "fused_loss=False" + (f" (fused_loss=True trains with {made.__name__})" if made else "")

    @override
    def why_not(self, run: Run) -> str | None:
        if takes_fused_loss(run.model):
            return None
        if isinstance(run.model, ClassificationModel):
            return ("ClassificationModel keeps ultralytics' cross-entropy, which needs no fused counterpart "
                    "(no host sync: its step replays from CUDA graphs as it is)")
        return (f"{type(run.model).__name__} keeps ultralytics' own loss: the fused losses implement "
                "v8DetectionLoss, v8PoseLoss, PoseLoss26, v8OBBLoss, v8SegmentationLoss and "
                "SegmentLoss26, and E2ELoss over them for YOLO26's heads")

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


__all__ = ["FUSED_LOSSES", "Augment", "LossSwap", "criterion", "fused_loss_class",
           "takes_fused_loss"]
