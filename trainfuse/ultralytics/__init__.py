"""trainfuse for ultralytics: FusedDetectionLoss (a sync-free, fused ``v8DetectionLoss``),
FusedE2ELoss (the same for ``E2ELoss``: YOLOv10, YOLO26) and the helpers that pad a batch's labels
on the CPU; FusedDetectionTrainer, and FusedDetectionValidator (batched, sync-free NMS and matching).
Importing this package does not import ultralytics."""

from trainfuse.losses.detection.targets import add_padded_targets, pad_targets, target_capacity
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss, takes_fused_e2e_loss
from trainfuse.ultralytics.loss import FusedDetectionLoss

__all__ = ["FusedDetectionLoss", "FusedDetectionTrainer", "FusedDetectionValidator", "FusedE2ELoss",
           "add_padded_targets", "pad_targets", "takes_fused_e2e_loss", "target_capacity"]


def __getattr__(name: str):
    # FusedDetectionTrainer and FusedDetectionValidator subclass ultralytics' trainer and validator:
    # they (and ultralytics) load on first use
    if name == "FusedDetectionTrainer":
        from trainfuse.ultralytics.trainer import FusedDetectionTrainer

        return FusedDetectionTrainer
    if name == "FusedDetectionValidator":
        from trainfuse.ultralytics.validate.validator import FusedDetectionValidator

        return FusedDetectionValidator
    raise AttributeError(f"module 'trainfuse.ultralytics' has no attribute {name!r}")
