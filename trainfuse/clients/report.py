"""What a client changed in a run, and what it left alone with the reason: one row each."""

from __future__ import annotations

import dataclasses

SWAPPED, SKIPPED, ON, OFF = "swapped", "skipped", "on", "off"


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a client's report.

    Attributes:
        kind: what the row is about: ``optimizer``, ``mlp``, ``loss``, ``clipping``, ``casts``,
            ``ema``, ``scaler``, ``graphs``, ``phase`` (the optimizer phase's CUDA graph),
            ``ddp``, ``stem``, ``augment``, ``validator``, ``precision``, ``strategy`` or ``backend``.
        name: which one (``optimizer 0 (AdamW)``, ``body``, ``crit``...).
        action: ``swapped``, ``skipped``, ``on`` or ``off``.
        detail: the reason, or what runs there now.
    """

    kind: str
    name: str
    action: str
    detail: str


class SkipError(RuntimeError):
    """Raised instead of a ``skipped`` row by a strict report."""


def format_rows(rows: list[Row], title: str) -> str:
    """The rows as a fixed-width table under ``title: N swapped, M skipped``."""
    header = ("kind", "name", "action", "detail")
    cells = [header] + [(r.kind, r.name, r.action, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = [f"{title}: {sum(r.action == SWAPPED for r in rows)} swapped, "
             f"{sum(r.action == SKIPPED for r in rows)} skipped"]
    for k, c in enumerate(cells):
        lines.append("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3])
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[3]))
    return "\n".join(lines)


class Report(list):
    """A list of :class:`Row` that raises :class:`SkipError` for a skip when ``strict``.

    Args:
        title: the client's name, first in the printed table.
        strict: refuse skips.
    """

    def __init__(self, title: str, strict: bool = False):
        super().__init__()
        self.title = title
        self.strict = strict

    def add(self, kind: str, name: str, action: str, detail: str) -> Row:
        if action == SKIPPED and self.strict:
            raise SkipError(f"{self.title}(strict=True): cannot apply to {kind} {name}: {detail}")
        row = Row(kind, name, action, detail)
        self.append(row)
        return row

    def reason(self, kind: str, applied: str, before: str) -> str:
        """Why the change of ``kind`` did not apply: "" where its first row's action is
        ``applied``, else that row's detail; ``before`` where it has no row yet."""
        row = next((r for r in self if r.kind == kind), None)
        return before if row is None else "" if row.action == applied else row.detail

    def __str__(self) -> str:
        return format_rows(list(self), self.title)


__all__ = ["OFF", "ON", "SKIPPED", "SWAPPED", "Report", "Row", "SkipError", "format_rows"]
