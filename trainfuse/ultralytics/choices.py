"""What :class:`~trainfuse.ultralytics.FusedDetectionTrainer` picks for a run: the task it trains,
the detection loss it installs, the fused optimizer that replaces ultralytics' own."""

from __future__ import annotations

from typing import Any

import torch
from ultralytics.nn.tasks import DetectionModel

from trainfuse.clients import swap_optimizer, why_not_swappable
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss, takes_fused_e2e_loss
from trainfuse.ultralytics.loss import FusedDetectionLoss

# ultralytics' optimizer_step clips the gradient norm at this value
CLIP_NORM = 10.0


def takes_fused_loss(model: torch.nn.Module) -> bool:
    """Whether a fused loss implements ``model``'s: a plain DetectionModel, end-to-end (YOLO26,
    YOLOv10: :class:`FusedE2ELoss`) or not (:class:`FusedDetectionLoss`)."""
    if type(model) is not DetectionModel:
        return False
    return takes_fused_e2e_loss(model) or getattr(model.model[-1], "one2one_cv2", None) is None


def criterion(model: torch.nn.Module) -> Any:
    """The detection loss :class:`FusedDetectionTrainer` installs on ``model``: the one place to
    switch it. :class:`~trainfuse.ultralytics.FusedE2ELoss` for end-to-end heads,
    :class:`~trainfuse.ultralytics.FusedDetectionLoss` for the others (:func:`takes_fused_loss`),
    else ultralytics' own ``model.init_criterion()``."""
    if takes_fused_e2e_loss(model):
        return FusedE2ELoss(model)
    return FusedDetectionLoss(model) if takes_fused_loss(model) else model.init_criterion()


def fused_optimizer(stock: torch.optim.Optimizer, max_grad_norm: float | None = CLIP_NORM
                    ) -> tuple[torch.optim.Optimizer | None, str]:
    """Rebuild ``stock`` (an optimizer ultralytics built) as its fused drop-in over the same groups.

    Args:
        stock: the optimizer; its param groups are reused with every key they carry.
        max_grad_norm: the global gradient norm the fused step clips to (None: no clipping).

    Returns:
        ``(fused optimizer, "")``, or ``(None, reason)`` when it stays stock
        (:func:`trainfuse.clients.why_not_swappable`: no fused counterpart, state already there...).
    """
    reason = why_not_swappable(stock, kernels=False, fresh=True)
    if reason is not None:
        return None, reason
    return swap_optimizer(stock, max_grad_norm=max_grad_norm), ""


def check_task(args: Any) -> None:
    """Refuse a run of another task (segment, pose, obb, classify): their heads and losses are not
    fused, and a detection trainer would train them half-way."""
    if args.task not in (None, "detect"):
        raise ValueError(
            f"FusedDetectionTrainer trains detection models (task='detect'); this run's task is "
            f"{args.task!r} (model={args.model}). Its head and loss are not fused: train it with "
            "ultralytics' own trainer (leave out trainer=), or pick a detection model")



__all__ = ["CLIP_NORM", "check_task", "criterion", "fused_optimizer", "takes_fused_loss"]
