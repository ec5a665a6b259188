"""Which validator validates the run's epochs (:class:`Validation`: a report row only; the trainer's
``get_validator`` chose it when ultralytics set the run up), and when its loader's workers start
(:class:`ValidationWorkers`). Detection validates with
:class:`~trainfuse.ultralytics.validate.validator.FusedDetectionValidator`; the other tasks with
ultralytics' own validator of the task, and the row says so.

ultralytics forks the validation loader's workers (twice the training loader's) at the first
validation, which then waits for them to start and load their first batches: about a second on
an H200 machine, as long as five later validations of our validator. :class:`ValidationWorkers`
forks them after the run's first optimizer step instead (the training loader's workers and
threads are up by then, as they are when ultralytics forks them), so that they load those batches
while the first epoch trains, below the training process's priority (``os.nice``): they take the
CPU time the training feed leaves idle. The batches, their order and the metrics are the same.
"""

from __future__ import annotations

from typing_extensions import override
from ultralytics.utils import RANK

from trainfuse.clients import ON, Row
from trainfuse.ultralytics import compat
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


# the workers' priority below the training process's: they load while the first epoch trains, and
# at the same priority they took about a second of that epoch's CPU time from the training feed
NICE = 10


class ValidationWorkers(Change):
    """The validation loader's workers forked after the first optimizer step (module docstring)."""

    kind = "val workers"

    def __init__(self) -> None:
        self._pending = False

    @override
    def name(self, run: Run) -> str:
        return "validation loader"

    @override
    def why_off(self, run: Run) -> str | None:
        if not run.trainer.args.val:
            return "val=False: the loader's workers start at the final validation, as ultralytics' do"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        loader = getattr(run.trainer, "test_loader", None)
        if RANK not in {-1, 0} or loader is None:
            return "no validation loader on this rank"
        if not getattr(loader, "num_workers", 0):
            return "the validation loader has no workers"
        return None

    @override
    def apply(self, run: Run) -> None:
        self._pending = True

    @override
    def before_optimizer_step(self, run: Run) -> None:
        if self._pending:
            self._pending = False
            compat.start_workers(run.trainer.test_loader, nice=NICE)

    @override
    def rows(self, run: Run) -> list[Row]:
        workers = run.trainer.test_loader.num_workers
        return [Row(self.kind, self.name(run), ON, f"its {workers} workers forked after the first optimizer "
                    f"step at a lower priority (nice +{NICE}), loading while the first epoch trains "
                    "(ultralytics forks them at the first validation)")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        self._pending = False


__all__ = ["Validation", "ValidationWorkers"]
