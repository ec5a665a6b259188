"""Which fused trainer trains which ultralytics task, and the check that a run's task is its trainer's."""

from __future__ import annotations

from typing import Any

# task -> (module, class) of its fused trainer; the modules import ultralytics, so they load on use
TRAINERS = {
    "detect": ("trainfuse.ultralytics.trainer", "FusedDetectionTrainer"),
    "segment": ("trainfuse.ultralytics.task_trainers", "FusedSegmentationTrainer"),
    "pose": ("trainfuse.ultralytics.task_trainers", "FusedPoseTrainer"),
    "obb": ("trainfuse.ultralytics.task_trainers", "FusedOBBTrainer"),
    "classify": ("trainfuse.ultralytics.task_trainers", "FusedClassificationTrainer"),
}


def task_of(model: Any) -> str:
    """The task of ``model``: a task name, a YOLO object, an ultralytics model (its ``task``
    attribute or what its head says) or a model file (``yolo11n-seg.pt``, ``yolo26n-pose.yaml``:
    what ultralytics guesses from it)."""
    if isinstance(model, str) and model in TRAINERS:
        return model
    task = getattr(model, "task", None)
    if isinstance(task, str):
        return task
    from ultralytics.nn.tasks import guess_model_task, yaml_model_load

    if isinstance(model, str) and model.endswith((".yaml", ".yml")):
        model = yaml_model_load(model)  # its head says the task, where its name may not
    return guess_model_task(model)


def trainer_for(model: Any) -> type:
    """The fused trainer of ``model``'s task: ``YOLO(m).train(trainer=trainer_for(m), ...)``.

    Args:
        model: a task name (``"segment"``), a ``YOLO`` object, an ultralytics model, or a model
            file or name (``"yolo11n-seg.pt"``).

    Raises:
        ValueError: for a task no fused trainer trains (``semantic``, ``depth``, ...).
    """
    import importlib

    task = task_of(model)
    if task not in TRAINERS:
        raise ValueError(f"trainer_for: no fused trainer trains task {task!r} (model={model!r}); the fused "
                         f"trainers train {', '.join(repr(t) for t in TRAINERS)}: train it with ultralytics' "
                         "own trainer (leave out trainer=)")
    module, name = TRAINERS[task]
    return getattr(importlib.import_module(module), name)


def check_task(trainer: type, args: Any) -> None:
    """Refuse a run whose task is not ``trainer``'s (its ``task``): another task's trainer would
    build the wrong dataset, loss and validator. Says which trainer trains it."""
    if args.task in (None, trainer.task):
        return
    other = TRAINERS.get(args.task)
    hint = (f"train it with {other[1]} (trainfuse.ultralytics.trainer_for(model) picks it)" if other else
            "no fused trainer trains it: train it with ultralytics' own trainer (leave out trainer=)")
    raise ValueError(f"{trainer.__name__} trains task {trainer.task!r}; this run's task is {args.task!r} "
                     f"(model={args.model}): {hint}")


__all__ = ["TRAINERS", "check_task", "task_of", "trainer_for"]
