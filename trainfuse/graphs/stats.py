"""The counts a captured step or a graphed module reports of what its calls did."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepStats:
    """What a :class:`~trainfuse.graphs.CapturedStep` or a :class:`~trainfuse.graphs.GraphedModule`
    did with the calls it graphs (a step: every call; a module: training calls on CUDA tensors with
    grad enabled): ``eager + replays`` is the number of those calls."""

    eager: int = 0  # calls that ran eagerly: first sightings, keys whose capture failed
    replays: int = 0  # calls answered by a graph replay, the capturing ones included
    captures: int = 0  # keys captured (for a GraphedModule, a key's three graphs at once)
    fallbacks: int = 0  # keys made eager by a failed capture or a host sync
    evictions: int = 0  # captured keys dropped to keep at most max_graphs
    # seconds the captures took (warm-up calls, capture, failed attempts included): not compared
    capture_s: float = dataclasses.field(default=0.0, compare=False)


__all__ = ["StepStats"]
