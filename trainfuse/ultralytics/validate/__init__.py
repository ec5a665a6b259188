"""Validation for ultralytics detection without host syncs inside a batch: batched NMS
(:mod:`~trainfuse.ultralytics.validate.nms`), batched matching of detections to labels
(:mod:`~trainfuse.ultralytics.validate.matching`), each a Triton kernel with a torch path, and
:class:`~trainfuse.ultralytics.validate.validator.FusedDetectionValidator`, ultralytics'
``DetectionValidator`` built on them."""

from trainfuse.ultralytics.validate.matching import match_detections, true_positives
from trainfuse.ultralytics.validate.nms import BatchedDetections, batched_nms

__all__ = ["BatchedDetections", "FusedDetectionValidator", "batched_nms", "match_detections",
           "true_positives"]


def __getattr__(name: str):
    # FusedDetectionValidator subclasses ultralytics' validator: it (and ultralytics) load on first use
    if name == "FusedDetectionValidator":
        from trainfuse.ultralytics.validate.validator import FusedDetectionValidator

        return FusedDetectionValidator
    raise AttributeError(f"module 'trainfuse.ultralytics.validate' has no attribute {name!r}")
