"""The optimizer phase inside the graph of each iteration ultralytics' loop steps after.

The loop steps when ``ni - last_opt_step >= accumulate`` (:data:`~trainfuse.ultralytics.compat.
STEPPING_RULE`, checked in the loop's source before training); ``last_opt_step`` is a local of the
loop, so :class:`StepCadence` counts the iterations since the last ``optimizer_step`` instead. A
new cadence starts at 0 wherever the loop's own count restarts (training start, a resume, a NaN
recovery: the changes are made again; an OOM retry: :meth:`StepCadence.restart`), and the loop's
count then starts at or above ours: a step is never predicted where the loop would not take one,
at worst one is missed, and then the phase runs on its own in ``optimizer_step``.

Such an iteration writes the phase's values first (``prepare_step``), its graph ends with the
phase and the grads zeroed, and the trainer's ``optimizer_step`` finds the step done
(:meth:`PhaseFold.optimizer_stepped`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainfuse.graphs import GraphedOptimizerStep


class StepCadence:
    """Which iterations ultralytics' loop steps the optimizer after: those where the iterations
    since its last ``optimizer_step``, this one included, reach ``accumulate`` (see the module)."""

    def __init__(self) -> None:
        self.since = 0  # iterations since the loop's last optimizer_step, this one included
        self.ran = False  # the last iteration ran the step; the loop's optimizer_step comes next

    def next_iteration(self, accumulate: int) -> bool:
        """Count one iteration; True where the loop steps after it (at ``accumulate`` as it is now)."""
        self.since += 1
        return self.since >= accumulate

    def optimizer_stepped(self) -> bool:
        """The loop's ``optimizer_step``: True where the last iteration already ran the step."""
        ran, self.ran = self.ran, False
        self.since = 0
        return ran

    def missed(self) -> bool:
        """True (once) where the last iteration ran the step and the loop did not step after it."""
        missed, self.ran = self.ran, False
        return missed

    def restart(self) -> None:
        """The loop restarts its count (an OOM retry sets ``last_opt_step = -1``)."""
        self.since, self.ran = 0, False


class PhaseFold:
    """Decides, before each graphed iteration, whether it ends with the optimizer phase.

    Args:
        phase: the trainer's optimizer phase over the grads the graphs accumulate into.
        accumulate: the loop's current ``accumulate`` (its warmup changes it).
    """

    def __init__(self, phase: GraphedOptimizerStep, accumulate: Callable[[], int]) -> None:
        self.phase = phase
        self._accumulate = accumulate
        self.cadence = StepCadence()

    def begin(self, renew_graphs: Callable[[], None]) -> bool:
        """An iteration begins: True where its graph ends with the phase (its ``prepare_step``
        then ran). ``renew_graphs`` drops the step's graphs, called where the graphs that ran the
        phase were made over tensors that changed since.

        Raises:
            RuntimeError: the last iteration ran the phase and the loop did not step after it (a
                loop that does not follow the stepping rule checked before training).
        """
        if self.cadence.missed():
            raise RuntimeError("GraphedLoss: the training loop did not call optimizer_step after an "
                               "iteration whose graph ran the optimizer phase: its stepping rule is not "
                               "ultralytics' (trainfuse.ultralytics.compat.STEPPING_RULE); train with "
                               "cuda_graphs=False")
        if not self.cadence.next_iteration(self._accumulate()) or not self.phase.ready_to_fold():
            return False
        if not self.phase.fold_holds():
            renew_graphs()  # its graphs ran the phase over tensors that changed
            return False
        self.phase.prepare()
        return True

    def ran(self, folded: bool) -> None:
        """The iteration's graph ran (``folded``: with the phase)."""
        self.cadence.ran = folded

    def failed(self) -> None:
        """The iteration raised (an OOM the loop retries restarts its count)."""
        self.cadence.restart()

    def optimizer_stepped(self) -> bool:
        """The loop's ``optimizer_step`` runs: True where the last iteration's graph ran the phase
        (the caller then skips it)."""
        return self.cadence.optimizer_stepped()

    def inside(self) -> None:
        """The phase's launches, inside the iteration's graph (after its backward), with autocast
        off: the loop's ``optimizer_step`` runs outside its autocast, and the graph's call comes
        from inside it (under it, Newton-Schulz's bfloat16 matmuls would run in float16)."""
        with torch.autocast("cuda", enabled=False):
            self.phase.inside()


__all__ = ["PhaseFold", "StepCadence"]
