"""The YOLO detection loss's ops, importable without ultralytics: the TaskAlignedAssigner
(:mod:`~trainfuse.losses.detection.assigner`), the box, DFL/L1 and class terms
(:mod:`~trainfuse.losses.detection.terms`, kernels in ``box_loss.py`` and ``cls_loss.py``), the
deterministic block sums they share (``sums.py``) and the labels padded on the CPU
(:mod:`~trainfuse.losses.detection.targets`). :mod:`trainfuse.ultralytics` ties them to
ultralytics' models (``FusedDetectionLoss``, ``FusedE2ELoss``)."""

from trainfuse.losses.detection.assigner import (
    AssignConfig,
    Assignment,
    assign_kernels,
    assign_torch,
    decode,
    distances,
)
from trainfuse.losses.detection.targets import (
    PADDED_KEY,
    PadTargets,
    add_padded_targets,
    anchor_grid,
    label_pixels,
    pad_targets,
    target_capacity,
)
from trainfuse.losses.detection.terms import (
    DetectionLossFunction,
    LossConstants,
    apply_detection_loss,
    loss_terms_torch,
)

__all__ = ["PADDED_KEY", "AssignConfig", "Assignment", "DetectionLossFunction", "LossConstants", "PadTargets",
           "add_padded_targets", "anchor_grid", "apply_detection_loss", "assign_kernels", "assign_torch",
           "decode", "distances", "label_pixels", "loss_terms_torch", "pad_targets", "target_capacity"]
