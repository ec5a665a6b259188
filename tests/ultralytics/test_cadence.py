"""StepCadence: which iterations ultralytics' loop steps the optimizer after, against the loop's own
rule (``ni - last_opt_step >= accumulate``, ``accumulate`` ramped by warmup), from a fresh start and
from a resume, where it may only be behind the loop, never ahead; and the loop that does not step."""

from __future__ import annotations

import numpy as np
import pytest

from trainfuse.ultralytics.phase_fold import StepCadence


def _warmup(nw: int, acc0: int, n: int) -> list[int]:
    """``accumulate`` at each iteration as ultralytics' warmup sets it (then its nominal value)."""
    return [max(1, int(np.interp(ni, [0, nw], [1, acc0]).round())) if ni <= nw else acc0 for ni in range(n)]


def _loop(accumulate: list[int], cadence: StepCadence, ni0: int = 0) -> tuple[list[bool], list[bool]]:
    """The loop's steps and the cadence's predictions, iteration by iteration (the loop's rule as
    ultralytics' ``_do_train`` writes it, ``last_opt_step = -1`` at its start)."""
    last_opt_step = -1
    steps, predicted = [], []
    for k, acc in enumerate(accumulate):
        ni = ni0 + k
        predicted.append(cadence.next_iteration(acc))
        cadence.ran = predicted[-1]
        steps.append(ni - last_opt_step >= acc)
        if steps[-1]:
            assert cadence.optimizer_stepped() == predicted[-1]
            last_opt_step = ni
        else:
            assert not cadence.missed(), f"a step predicted at ni={ni} that the loop does not take"
    return steps, predicted


@pytest.mark.parametrize("nw,acc0", [(100, 4), (100, 1), (37, 8), (0, 4), (5, 2)])
def test_from_the_start_it_predicts_every_step_of_the_loop(nw, acc0):
    accumulate = _warmup(nw, acc0, 400)
    steps, predicted = _loop(accumulate, StepCadence())
    assert predicted == steps
    assert sum(steps) >= 400 // acc0 + (acc0 > 1 and nw > 0)  # warmup's smaller accumulates step more often


@pytest.mark.parametrize("start_epoch,nb", [(3, 10), (1, 2), (5, 7)])
def test_after_a_resume_it_is_never_ahead_and_agrees_from_the_first_step(start_epoch, nb):
    """A resumed loop restarts ``last_opt_step`` at -1 at ``ni = nb * start_epoch``, so its first
    step comes early; a fresh cadence counts from 0: it misses that one step (``_loop`` checks it is
    never ahead) and agrees after."""
    accumulate = [4] * 60
    steps, predicted = _loop(accumulate, StepCadence(), ni0=nb * start_epoch)
    first = steps.index(True)
    assert first == max(0, 3 - nb * start_epoch) and not predicted[first]
    assert predicted[first + 1:] == steps[first + 1:]


def test_a_loop_that_does_not_step_is_reported_once_and_restart_counts_anew():
    cadence = StepCadence()
    assert not cadence.next_iteration(2) and cadence.next_iteration(2)
    cadence.ran = True  # the call ran the step; the loop goes on without optimizer_step
    assert cadence.missed() and not cadence.missed()
    cadence.restart()
    assert not cadence.next_iteration(2) and cadence.next_iteration(2)
    cadence.ran = True
    assert cadence.optimizer_stepped() and not cadence.missed()
    assert not cadence.next_iteration(3)  # counting from the step
