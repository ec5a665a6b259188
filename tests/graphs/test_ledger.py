"""GraphLedger: the bookkeeping CapturedStep and GraphedModule share. A key's failure makes it eager
for good with the first line of why, the first failure warns once at the caller's line, a failed
capture renews the pool, and the counts add up across a clear."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import trainfuse.graphs as graphs
from trainfuse.graphs import Action, CapturedStep, GraphedModule, GraphPool, StepStats
from trainfuse.graphs import ledger as ledger_module
from trainfuse.graphs.ledger import GraphLedger
from trainfuse.graphs.stats import StepStats as StatsModuleStepStats

STEP_WARNING = ("CapturedStep 'train': could not capture a CUDA graph, so inputs of this shape run "
                "eagerly from now on ({}); later failures are listed in .reasons")


class Entry:
    """A stand-in for a captured graph: hashed by identity, weakly referenced, as GraphPool needs."""


def make(max_graphs: int = 8, pool: GraphPool | None = None) -> GraphLedger:
    return GraphLedger("CapturedStep", "train", max_graphs=max_graphs, pool=pool or GraphPool(),
                       eagerly="inputs of this shape run eagerly from now on")


def sighted_twice(ledger: GraphLedger, key: str) -> None:
    assert ledger.lookup(key)[0] is Action.EAGER
    assert ledger.lookup(key)[0] is Action.CAPTURE


def ours(caught: list) -> list:
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


# ---- failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("error, reason", [
    (RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors..."),
     "RuntimeError: operation not permitted when stream is capturing"),
    (TypeError("  fn's output[1] is a Python float  "), "TypeError: fn's output[1] is a Python float"),
    (ValueError(), "ValueError: (no message)"),
], ids=["multi-line", "padded", "empty"])
def test_a_failed_key_runs_eagerly_for_good_with_the_first_line_of_why(error, reason):
    ledger = make()
    sighted_twice(ledger, "a")
    with pytest.warns(RuntimeWarning):
        ledger.fail("a", error)
    assert ledger.reasons == {"a": reason}
    assert [ledger.lookup("a") for _ in range(2)] == [(Action.FALLBACK, None)] * 2
    assert ledger.stats == StepStats(fallbacks=1)


def test_only_the_first_failure_warns_and_it_names_the_client_and_the_reason():
    ledger = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ledger.fail("a", RuntimeError("first"))
        ledger.fail("b", RuntimeError("second"))
        ledger.warn("an argument is not hashable")
        ledger.clear()  # the warning stays given
        ledger.fail("c", RuntimeError("third"))
    assert [str(w.message) for w in ours(caught)] == [STEP_WARNING.format("RuntimeError: first")]
    assert ledger.reasons == {"c": "RuntimeError: third"}
    assert ledger.stats.fallbacks == 3


def test_a_warning_alone_lists_no_reason():
    ledger = make()
    with pytest.warns(RuntimeWarning, match=r"eagerly from now on \(unhashable\)"):
        ledger.warn("unhashable")
    assert ledger.reasons == {} and ledger.stats == StepStats()


def test_the_warning_points_at_the_line_that_called_into_the_package():
    ledger = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        ledger.fail("a", RuntimeError("boom"))
    (w,) = ours(caught)
    assert (w.filename, w.lineno) == (__file__, line)


def test_the_warning_looks_past_torchs_module_call():
    """A GraphedModule warns from inside nn.Module.__call__: the warning names the caller's line."""
    ledger = make()
    module = torch.nn.Module()
    module.forward = ledger.warn  # called as a graphed forward is: through nn.Module.__call__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        module("unhashable")
    (w,) = ours(caught)
    assert (w.filename, w.lineno) == (__file__, line)


def test_a_failed_capture_renews_the_pool_and_a_stored_one_keeps_it():
    pool = GraphPool()
    ledger = make(pool=pool)
    first = pool.handle()
    sighted_twice(ledger, "a")
    entry = Entry()
    ledger.store("a", entry)
    assert pool.handle() == first
    sighted_twice(ledger, "b")
    with pytest.warns(RuntimeWarning):
        ledger.capture_failed("b", RuntimeError("invalidated"))
    second = pool.handle()
    assert second != first
    assert ledger.lookup("a") == (Action.REPLAY, entry)  # graphs made before stay
    assert ledger.reasons == {"b": "RuntimeError: invalidated"}
    assert ledger.stats == StepStats(captures=1, fallbacks=1)


# ---- first sightings ------------------------------------------------------------------------------
def test_a_first_sighting_that_syncs_makes_its_key_eager(monkeypatch):
    def watched(device, fn, /, *args, **kwargs):
        return fn(*args, **kwargs), "called a synchronizing CUDA operation (from step.py:3)"

    monkeypatch.setattr(ledger_module, "watching_syncs", watched)
    ledger = make()
    ledger.lookup("a")
    with pytest.warns(RuntimeWarning, match="fn synchronizes with the host"):
        # arguments named like the ledger's own reach fn
        out = ledger.first_sighting("a", torch.device("cpu"), "fn", lambda key, device: (key, device),
                                    key=1, device=2)
    assert out == (1, 2)
    assert ledger.reasons == {"a": "RuntimeError: fn synchronizes with the host: called a synchronizing "
                                   "CUDA operation (from step.py:3)"}
    assert ledger.lookup("a")[0] is Action.FALLBACK


def test_a_first_sighting_that_raises_is_no_sighting(monkeypatch):
    monkeypatch.setattr(ledger_module, "watching_syncs", lambda device, fn, /, *a, **k: (fn(*a, **k), None))
    ledger = make()
    ledger.lookup("a")

    def fails():
        raise KeyError("batch")

    with pytest.raises(KeyError):
        ledger.first_sighting("a", torch.device("cpu"), "fn", fails)
    assert ledger.lookup("a")[0] is Action.EAGER  # unseen again
    assert ledger.first_sighting("a", torch.device("cpu"), "fn", lambda: 5) == 5
    assert ledger.lookup("a")[0] is Action.CAPTURE


# ---- counts and reports ---------------------------------------------------------------------------
def test_counts_add_up_and_evictions_survive_a_clear():
    ledger = make(max_graphs=1)
    for key in ("a", "b"):
        sighted_twice(ledger, key)
        ledger.ran_eagerly()
        ledger.store(key, Entry())
        ledger.replayed()
    ledger.replayed()
    assert ledger.stats == StepStats(eager=2, replays=3, captures=2, evictions=1)
    ledger.clear()
    assert ledger.lookup("b")[0] is Action.EAGER  # unseen again
    assert ledger.stats == StepStats(eager=2, replays=3, captures=2, evictions=1)


def test_stats_are_a_snapshot():
    ledger = make()
    snapshot = ledger.stats
    snapshot.eager += 5
    ledger.replayed()
    assert ledger.stats == StepStats(replays=1) and snapshot == StepStats(eager=5)


def test_nothing_to_report_before_a_call():
    assert make().memory_report() == {"peak_before_capture": None, "peak_now": None}


# ---- the clients --------------------------------------------------------------------------------
def test_step_stats_is_one_class_for_both_clients():
    assert graphs.StepStats is StepStats is StatsModuleStepStats
    assert type(CapturedStep(lambda x: x).stats) is StepStats
    assert type(GraphedModule(torch.nn.Linear(2, 2)).stats) is StepStats


def test_a_step_renamed_after_construction_is_called_by_its_new_name():
    step = CapturedStep(lambda x: x, name="before")
    step.name = "after"
    assert step.name == "after"
    with pytest.raises(ValueError, match="CapturedStep 'after': no inputs"):
        step()


def test_a_module_renamed_after_construction_is_called_by_its_new_name():
    graphed = GraphedModule(torch.nn.Linear(2, 2), name="before")
    graphed.name = "after"
    assert graphed.name == "after"
    with pytest.raises(TypeError, match="GraphedModule 'after': copy the module"):
        copy.deepcopy(graphed)
