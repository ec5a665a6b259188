"""Which validator validates the run's epochs: a report row only (the trainer's ``get_validator``
chose it when ultralytics set the run up; nothing is changed here). Detection validates with
:class:`~trainfuse.ultralytics.validate.validator.FusedDetectionValidator`; the other tasks with
ultralytics' own validator of the task, and the row says so.
"""

from __future__ import annotations

from typing_extensions import override

from trainfuse.clients import ON, Row
from trainfuse.ultralytics.changes.base import Change, Run
from trainfuse.ultralytics.validate.validator import FusedDetectionValidator


class Validation(Change):
    """The run's validator (module docstring)."""

    kind = "validator"

    @override
    def name(self, run: Run) -> str:
        validator = getattr(run.trainer, "validator", None)
        return "validator" if validator is None else type(validator).__name__

    @override
    def why_not(self, run: Run) -> str | None:
        validator = getattr(run.trainer, "validator", None)
        if validator is None:
            return "no validator was built"
        if isinstance(validator, FusedDetectionValidator):
            return None
        return (f"ultralytics' own {type(validator).__name__} validates the {run.trainer.args.task!r} run: "
                "the fused validator (batched, sync-free NMS and matching on the GPU) covers detection's "
                "boxes")

    @override
    def rows(self, run: Run) -> list[Row]:
        return [Row(self.kind, self.name(run), ON, "batched, sync-free NMS and matching on the GPU, the "
                    "EMA's forward from CUDA graphs where the step's are on; ultralytics' metrics")]


__all__ = ["Validation"]
