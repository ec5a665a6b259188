"""trainfuse for ultralytics: FusedDetectionLoss (a sync-free, fused ``v8DetectionLoss``),
FusedE2ELoss (the same for ``E2ELoss``: YOLOv10, YOLO26), FusedPoseLoss (``v8PoseLoss``),
FusedOBBLoss (``v8OBBLoss``), FusedSegmentationLoss (``v8SegmentationLoss``) and the helpers that
pad a batch's labels on the CPU; the fused trainers of every task (FusedDetectionTrainer,
FusedSegmentationTrainer, FusedPoseTrainer, FusedOBBTrainer, FusedClassificationTrainer;
``trainer_for(model)`` picks one), and FusedDetectionValidator (batched, sync-free NMS and
matching). Importing this package does not import ultralytics."""

from trainfuse.losses.detection.targets import add_padded_targets, pad_targets, target_capacity
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss, takes_fused_e2e_loss
from trainfuse.ultralytics.loss import FusedDetectionLoss
from trainfuse.ultralytics.obb_loss import FusedOBBLoss
from trainfuse.ultralytics.pose_loss import FusedPoseLoss
from trainfuse.ultralytics.segment_loss import FusedSegmentationLoss
from trainfuse.ultralytics.tasks import TRAINERS, trainer_for

__all__ = ["FusedClassificationTrainer", "FusedDetectionLoss", "FusedDetectionTrainer",
           "FusedDetectionValidator", "FusedE2ELoss", "FusedOBBLoss", "FusedOBBTrainer", "FusedPoseLoss",
           "FusedPoseTrainer", "FusedSegmentationLoss", "FusedSegmentationTrainer", "add_padded_targets",
           "pad_targets",
           "takes_fused_e2e_loss", "target_capacity", "trainer_for"]


def __getattr__(name: str):
    # the trainers and the validator subclass ultralytics' own: they (and ultralytics) load on first use
    for module, trainer in TRAINERS.values():
        if name == trainer:
            import importlib

            return getattr(importlib.import_module(module), name)
    if name == "FusedDetectionValidator":
        from trainfuse.ultralytics.validate.validator import FusedDetectionValidator

        return FusedDetectionValidator
    raise AttributeError(f"module 'trainfuse.ultralytics' has no attribute {name!r}")
