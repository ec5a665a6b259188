"""Which ultralytics tasks the fused trainer takes."""

from __future__ import annotations

from typing import Any


def check_task(args: Any) -> None:
    """Refuse a run of another task (segment, pose, obb, classify): their heads and losses are not
    fused, and a detection trainer would train them half-way."""
    if args.task not in (None, "detect"):
        raise ValueError(
            f"FusedDetectionTrainer trains detection models (task='detect'); this run's task is "
            f"{args.task!r} (model={args.model}). Its head and loss are not fused: train it with "
            "ultralytics' own trainer (leave out trainer=), or pick a detection model")


__all__ = ["check_task"]
