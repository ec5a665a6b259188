"""The fused trainers of ultralytics' other tasks: segmentation, pose, oriented boxes and
classification, each ultralytics' own trainer of the task with what
:class:`~trainfuse.ultralytics.fused_trainer.FusedTrainer` adds
(``YOLO("yolo11n-seg.yaml").train(trainer=FusedSegmentationTrainer, ...)``;
:func:`trainfuse.ultralytics.trainer_for` picks the one of a model).

What each task takes today, the rest staying stock with its row in the trainer's ``report``:
the fused optimizer phase with the EMA inside it, the 16-bit weights with float32 masters, the
prefetch to the GPU and the checkpoints written beside training. ultralytics' losses of masks,
keypoints and rotated boxes sync with the host; the segmentation, pose and OBB trainers train
with trainfuse's sync-free ones (FusedSegmentationLoss, FusedPoseLoss, FusedOBBLoss and YOLO26's
end-to-end counterparts), and the step replays from CUDA graphs fed the padded labels with their
keypoints or masks (``fused_loss=False``: ultralytics' loss, the step eager). Classification's
cross-entropy needs no fused loss: its step replays from graphs fed the classes. Segment, pose
and OBB images augment on the CPU unless ``gpu_augment=True`` (then their pixels on the GPU, their
labels moved by ultralytics' own code as detection's are); classification's transforms stay on
the CPU; and each task validates with ultralytics' own validator.
"""

from __future__ import annotations

from ultralytics.models.yolo.classify import ClassificationTrainer
from ultralytics.models.yolo.obb import OBBTrainer
from ultralytics.models.yolo.pose import PoseTrainer
from ultralytics.models.yolo.segment import SegmentationTrainer

from trainfuse.ultralytics.fused_trainer import FusedTrainer


class FusedSegmentationTrainer(FusedTrainer, SegmentationTrainer):
    """ultralytics' ``SegmentationTrainer``, fused as the module says: a ``v8SegmentationLoss``
    model trains with :class:`~trainfuse.ultralytics.FusedSegmentationLoss`, YOLO26's with
    FusedE2ESegment26Loss, its step replayed from CUDA graphs (``fused_loss=False``: ultralytics'
    loss, the step eager)."""

    task = "segment"


class FusedPoseTrainer(FusedTrainer, PoseTrainer):
    """ultralytics' ``PoseTrainer``, fused as the module says: a ``v8PoseLoss`` model trains with
    :class:`~trainfuse.ultralytics.FusedPoseLoss`, YOLO26's with FusedE2EPose26Loss, its step
    replayed from CUDA graphs (``fused_loss=False``: ultralytics' loss, the step eager)."""

    task = "pose"


class FusedOBBTrainer(FusedTrainer, OBBTrainer):
    """ultralytics' ``OBBTrainer``, fused as the module says: a ``v8OBBLoss`` model trains with
    :class:`~trainfuse.ultralytics.FusedOBBLoss`, YOLO26's with FusedE2EOBBLoss, its step
    replayed from CUDA graphs (``fused_loss=False``: ultralytics' loss, the step eager)."""

    task = "obb"


class FusedClassificationTrainer(FusedTrainer, ClassificationTrainer):
    """ultralytics' ``ClassificationTrainer``, fused as the module says."""

    task = "classify"


__all__ = ["FusedClassificationTrainer", "FusedOBBTrainer", "FusedPoseTrainer", "FusedSegmentationTrainer"]
