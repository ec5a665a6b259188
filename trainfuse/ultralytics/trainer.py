"""FusedDetectionTrainer: ultralytics' DetectionTrainer with trainfuse's optimizer phase, loss and
validator, ``YOLO("yolov5n.yaml").train(data="data.yaml", trainer=FusedDetectionTrainer)``
(:mod:`trainfuse.ultralytics.fused_trainer`: what every fused trainer changes).
"""

from __future__ import annotations

from copy import copy

from typing_extensions import override
from ultralytics.models.yolo.detect import DetectionTrainer

from trainfuse.ultralytics.fused_trainer import OPTIONS, FusedTrainer
from trainfuse.ultralytics.validate.validator import FusedDetectionValidator


class FusedDetectionTrainer(FusedTrainer, DetectionTrainer):
    """``ultralytics.models.yolo.detect.DetectionTrainer`` with a fused optimizer phase, the fused
    detection loss, CUDA graphs, the GPU data path and the fused validator:
    ``YOLO("yolov5n.yaml").train(trainer=FusedDetectionTrainer, ...)``; its options are
    :class:`~trainfuse.ultralytics.fused_trainer.FusedTrainer`'s."""

    task = "detect"

    @override
    def get_validator(self):
        """ultralytics' validator with batched, sync-free NMS and matching, the EMA's forward from
        CUDA graphs where the step's are on (:class:`~trainfuse.ultralytics.validate.validator.
        FusedDetectionValidator`)."""
        validator = FusedDetectionValidator(self.test_loader, save_dir=self.save_dir, args=copy(self.args),
                                            _callbacks=self.callbacks)
        validator.cuda_graphs = self.cuda_graphs
        return self.plots_in_workers(validator)


__all__ = ["OPTIONS", "FusedDetectionTrainer"]
