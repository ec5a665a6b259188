"""The shape of every change a client makes to a run, and the list that makes and undoes them.

A change is a small object that says why it does not apply, applies, says what runs now, and
undoes itself. A client (Lightning's ``FusedTraining``, ultralytics' ``FusedDetectionTrainer``)
builds its list of changes, hands it to an :class:`AppliedChanges` at the start of training, and
asks it to undo them in reverse order when training ends, on an exception, and (ultralytics)
around a checkpoint load. Modelled on Composer's algorithms (each declares what it changes and
reports when it matched nothing) and Lightning's weight-averaging callbacks (hooks named for when
they act).

Adding a change to a client is one subclass and one line in that client's list. "No reason" is
``None`` everywhere; every report row comes from a change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, Generic, TypeVar

from trainfuse.clients.report import OFF, SKIPPED, Report, Row

RunT = TypeVar("RunT")


class Change(Generic[RunT]):
    """One thing a client changes in a run; ``RunT`` is what the client tells its changes about
    the run (Lightning's Trainer and module, ultralytics' trainer).

    Subclasses set :attr:`kind` and override what they need; every method has a do-nothing
    default. :meth:`AppliedChanges.apply`, for each change in order: writes an ``off`` row if
    :meth:`why_off` gives a reason, else a ``skipped`` row if :meth:`why_not` does (and, for a
    change that :attr:`ends_run`, changes nothing more), else calls :meth:`apply` and writes
    :meth:`rows`.
    """

    kind: ClassVar[str]
    # a skip of this change leaves the whole run stock (an unsupported precision or strategy)
    ends_run: ClassVar[bool] = False

    def name(self, run: RunT) -> str:
        """What the change's ``off``/``skipped`` row is about."""
        return "-"

    def why_off(self, run: RunT) -> str | None:
        """Why there is nothing to change (turned off, or nothing matched): an ``off`` row."""
        return None

    def why_not(self, run: RunT) -> str | None:
        """Why this run cannot take the change: a ``skipped`` row. None: it can."""
        return None

    def apply(self, run: RunT) -> None:
        """Make the change."""

    def rows(self, run: RunT) -> list[Row]:
        """After :meth:`apply`: what runs now, one row per thing changed or left alone."""
        return []

    def restore(self, run: RunT, *, failed: bool) -> None:
        """Undo the change (in reverse order of the list). ``failed``: training raised; else it
        ended, or a checkpoint is about to be loaded (the change is applied again after it)."""


class AppliedChanges(Generic[RunT]):
    """The changes made to one run, in the order they were made.

    Args:
        report: where each change's rows go (a strict report raises on a skip).
        log: called with each row as it is added (None: rows are only collected).
    """

    def __init__(self, report: Report, log: Callable[[Row], None] | None = None) -> None:
        self.report = report
        self.log = log
        self.changes: list[Change[RunT]] = []

    def __iter__(self):
        return iter(self.changes)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def find(self, cls: type) -> Change[RunT] | None:
        """The applied change of class ``cls``, or None."""
        return next((c for c in self.changes if isinstance(c, cls)), None)

    def _add(self, row: Row) -> None:
        self.report.add(row.kind, row.name, row.action, row.detail)
        if self.log is not None:
            self.log(row)

    def apply(self, changes: Iterable[Change[RunT]], run: RunT, *, report: bool = True) -> None:
        """Make every change of ``changes`` that applies, in order, writing their rows (see
        :class:`Change`; ``report=False``: no rows, for changes made again after a checkpoint
        load). A change that raises while applying is undone with the ones before it
        (``failed=True``), and the error propagates."""
        try:
            for change in changes:
                off = change.why_off(run)
                reason = change.why_not(run) if off is None else None
                if off is not None or reason is not None:
                    if report:
                        self._add(Row(change.kind, change.name(run), OFF if reason is None else SKIPPED,
                                      off if reason is None else reason))
                    if reason is not None and change.ends_run:
                        break
                    continue
                change.apply(run)
                self.changes.append(change)
                for row in change.rows(run) if report else ():
                    self._add(row)
        except BaseException:
            self.restore(run, failed=True)
            raise

    def restore(self, run: RunT, *, failed: bool) -> list[Change[RunT]]:
        """Undo every applied change in reverse order (each one, even when another raises: the
        first error is raised after all were tried). Returns them, in the order they were made,
        for a client that applies them again (around a checkpoint load)."""
        applied, self.changes = self.changes, []
        errors = []
        for change in reversed(applied):
            try:
                change.restore(run, failed=failed)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return applied


__all__ = ["AppliedChanges", "Change", "RunT"]
