"""The bookkeeping of a graphed call, kept once for :class:`~trainfuse.graphs.CapturedStep` and
:class:`~trainfuse.graphs.GraphedModule`.

Per key, a :class:`GraphLedger` knows the captured entry or why the key runs eagerly (its
:class:`~trainfuse.graphs.cache.ShapeCache`); it counts what the calls did
(:class:`~trainfuse.graphs.stats.StepStats`), holds the :class:`~trainfuse.graphs.pool.GraphPool`
captures allocate from, and notes the peak memory before the first capture.

Every failure of a key is handled the same way: a host sync in its eager first sighting, a capture
that raised, an output a replay cannot return. The key runs eagerly for good, with the first line
of the error in ``.reasons``; the first failure of the step or module warns once
(:class:`RuntimeWarning`, pointing at the line that called it); after a failed capture, later
captures start a fresh pool.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

from trainfuse.graphs.cache import Action, ShapeCache
from trainfuse.graphs.pool import GraphPool
from trainfuse.graphs.stats import StepStats
from trainfuse.graphs.sync import watching_syncs

Entry = TypeVar("Entry")

# the files a warning looks past to name the line that called the step or module: this package's,
# and torch's (nn.Module.__call__ runs between a caller and a graphed forward)
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by this function's caller name the first
    frame outside :data:`_INTERNAL`."""
    frame, level = inspect.currentframe(), 0  # level 0: this function, level 1: the warning's caller
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return max(level, 1)


class GraphLedger(Generic[Entry]):
    """What a graphed callable keeps besides its graphs; see the module docstring.

    Args:
        kind: the client's class name, the first word of its warnings and errors.
        name: how the client's warnings and errors call it.
        max_graphs: entries kept at once; the least recently used is dropped beyond it.
        pool: the pool captures allocate from.
        eagerly: what a failure makes run eagerly, as the warning says it ("these calls run eagerly").
    """

    def __init__(self, kind: str, name: str, *, max_graphs: int, pool: GraphPool, eagerly: str) -> None:
        self.kind = kind
        self.name = name
        self.pool = pool
        self.device: torch.device | None = None  # of the latest call: memory_report reads its peak
        self._eagerly = eagerly
        self._cache: ShapeCache[Entry] = ShapeCache(max_graphs)
        self._counts = StepStats()
        self._warned = False
        self._peak_before_capture: int | None = None
        self._capture_started = 0.0

    @property
    def who(self) -> str:
        """The client as its warnings and errors name it: ``CapturedStep 'train'``."""
        return f"{self.kind} {self.name!r}"

    # ---- a call ----------------------------------------------------------------------------------
    def lookup(self, key: Hashable) -> tuple[Action, Entry | None]:
        """The action for this call of ``key``, and its entry where that is a replay
        (:meth:`ShapeCache.lookup <trainfuse.graphs.cache.ShapeCache.lookup>`)."""
        return self._cache.lookup(key)

    def ran_eagerly(self) -> None:
        """Count a call that ran eagerly."""
        self._counts.eager += 1

    def replayed(self) -> None:
        """Count a call answered by a replay."""
        self._counts.replays += 1

    def first_sighting(self, key: Hashable, device: torch.device, subject: str, fn: Callable[..., Any], /,
                       *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` eagerly on the side stream, watched for host syncs.

        A sync makes ``key`` eager for good (the reason names ``fn`` as ``subject``): its capture
        would fail, and a failed capture can leave torch's CUDA RNG in capture mode. A call that
        raises is no sighting: ``key`` is unseen again.

        Returns:
            What ``fn`` returned.
        """
        try:
            out, sync = watching_syncs(device, fn, *args, **kwargs)
        except BaseException:
            self._cache.forget(key)
            raise
        if sync is not None:
            self.fail(key, RuntimeError(f"{subject} synchronizes with the host: {sync}"))
        return out

    # ---- a capture -------------------------------------------------------------------------------
    def before_capture(self, device: torch.device) -> None:
        """A capture starts: note the time, and the peak memory on ``device`` if no capture came
        before."""
        self._capture_started = time.perf_counter()
        if self._peak_before_capture is None:
            self._peak_before_capture = torch.cuda.max_memory_allocated(device)

    def store(self, key: Hashable, entry: Entry) -> None:
        """Keep ``entry``, the graphs just captured for ``key`` into :attr:`pool`; the pool counts
        them alive while ``entry`` is."""
        self._cache.store(key, entry)
        self.pool.hold(entry)
        self._counts.captures += 1
        self._counts.capture_s += time.perf_counter() - self._capture_started

    def capture_failed(self, key: Hashable, error: BaseException) -> None:
        """``key``'s capture raised ``error`` or made an entry that cannot be kept: :meth:`fail`,
        and later captures start a fresh pool (the attempt's graphs are freed, and torch cannot
        capture into a pool all of whose graphs were freed: see :class:`GraphPool`)."""
        self._counts.capture_s += time.perf_counter() - self._capture_started
        self.pool.renew()
        self.fail(key, error)

    def fail(self, key: Hashable, error: BaseException) -> None:
        """Run ``key`` eagerly for good, with the first line of ``error`` as the reason; warn if
        this is the first failure."""
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"
        self._cache.fail(key, reason)
        self._counts.fallbacks += 1
        self.warn(reason)

    def warn(self, reason: str) -> None:
        """Warn that calls run eagerly because of ``reason``, once per ledger."""
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"{self.who}: could not capture a CUDA graph, so {self._eagerly} ({reason}); "
                      f"later failures are listed in .reasons", RuntimeWarning,
                      stacklevel=_caller_stacklevel())

    def clear(self) -> None:
        """Drop every entry (freeing its graphs), sighting and failure: every key is unseen again.
        The counts go on; the warning stays given."""
        self._cache.clear()

    # ---- reports ---------------------------------------------------------------------------------
    @property
    def stats(self) -> StepStats:
        """A snapshot of the counts."""
        return dataclasses.replace(self._counts, evictions=self._cache.evictions)

    @property
    def reasons(self) -> dict[Hashable, str]:
        """The keys that run eagerly because of a failure, oldest first, with the first line of why."""
        return self._cache.reasons

    def memory_report(self) -> dict[str, int | None]:
        """The peak memory before the first capture and now (see :meth:`LedgerReports.memory_report`)."""
        now = None if self.device is None else torch.cuda.max_memory_allocated(self.device)
        return {"peak_before_capture": self._peak_before_capture, "peak_now": now}


class LedgerReports:
    """What a captured step or a graphed module reports, read from the :class:`GraphLedger` it
    keeps as ``self._ledger``."""

    _ledger: GraphLedger

    @property
    def name(self) -> str:
        """How its warnings, errors and reports call it."""
        return self._ledger.name

    @name.setter
    def name(self, value: str) -> None:
        self._ledger.name = value

    @property
    def stats(self) -> StepStats:
        """A snapshot of the counts of eager calls, replays, captures, failures and evictions."""
        return self._ledger.stats

    @property
    def reasons(self) -> dict[Hashable, str]:
        """The keys that run eagerly because of a host sync or a failed capture, oldest first, each
        with the first line of why."""
        return self._ledger.reasons

    def memory_report(self) -> dict[str, int | None]:
        """Peak memory before the first capture and now, for comparing a captured run with an eager one.

        Returns:
            ``peak_before_capture``: ``torch.cuda.max_memory_allocated`` on the device right before
            the first capture (None until then); ``peak_now``: the same now (None before the first
            call on CUDA tensors). Both count everything since the last ``reset_peak_memory_stats``.
        """
        return self._ledger.memory_report()


__all__ = ["GraphLedger", "LedgerReports"]
