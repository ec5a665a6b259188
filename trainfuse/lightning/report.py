"""What FusedTraining changed in a run: one row per optimizer, module, loss and setting."""

from __future__ import annotations

import dataclasses

SWAPPED, SKIPPED, ON, OFF = "swapped", "skipped", "on", "off"


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the report.

    Attributes:
        kind: ``optimizer``, ``mlp``, ``loss``, ``clipping``, ``casts``, ``ema``, ``scaler``,
            ``precision``, ``strategy`` or ``backend``.
        name: what the row is about (``optimizer 0 (AdamW)``, ``body``, ``crit``...).
        action: ``swapped``, ``skipped``, ``on`` or ``off``.
        detail: the reason, or what the callback does there.
    """

    kind: str
    name: str
    action: str
    detail: str


class SkipError(RuntimeError):
    """Raised instead of a ``skipped`` row under ``FusedTraining(strict=True)``."""


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table, one line each."""
    header = ("kind", "name", "action", "detail")
    cells = [header] + [(r.kind, r.name, r.action, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = [f"FusedTraining: {sum(r.action == SWAPPED for r in rows)} swapped, "
             f"{sum(r.action == SKIPPED for r in rows)} skipped"]
    for k, c in enumerate(cells):
        lines.append("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3])
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[3]))
    return "\n".join(lines)


class Report(list):
    """``callback.report``: a list of :class:`Row` that refuses skips when ``strict``."""

    def __init__(self, strict: bool):
        super().__init__()
        self.strict = strict

    def add(self, kind: str, name: str, action: str, detail: str) -> None:
        if action == SKIPPED and self.strict:
            raise SkipError(f"FusedTraining(strict=True): cannot apply to {kind} {name}: {detail}")
        self.append(Row(kind, name, action, detail))

    def __str__(self) -> str:
        return format_table(list(self))


__all__ = ["OFF", "ON", "SKIPPED", "SWAPPED", "Report", "Row", "SkipError", "format_table"]
