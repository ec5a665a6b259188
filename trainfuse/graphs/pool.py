"""The memory pool that a captured step or the graphed modules of a step capture into."""

from __future__ import annotations

import weakref
from typing import Any

import torch


class GraphPool:
    """One CUDA-graph memory pool for a :class:`CapturedStep`, or for the :class:`GraphedModule`
    objects given it.

    A graphed module keeps everything its graphs hold from one replay to the next allocated (its
    static inputs and outputs, the activations its forward saves for its backward, its input
    grads); what a graph frees during its capture is scratch it only uses while it runs. So the
    modules of one step may replay in any order from one pool, as long as they run on one stream:
    each takes another's scratch only while that one is not running. A pool of their own each
    would keep every module's scratch apart.

    A pool lives while a graph captured into it lives: once every graph is freed (all modules
    dropped theirs), the next capture starts a new pool, as torch cannot share a released one.

    Args:
        handle: a pool id (``torch.cuda.graph_pool_handle()``) to capture into first; None: one
            made at the first capture.
    """

    def __init__(self, handle: Any = None) -> None:
        self._handle = handle
        self._owners: weakref.WeakSet = weakref.WeakSet()  # what holds the graphs captured so far
        self._held = False  # whether a capture into this handle was held

    def handle(self) -> Any:
        """The pool's id for ``capture_begin``: a new one once every graph captured is freed."""
        if self._handle is None or (self._held and not self._owners):
            self._handle = torch.cuda.graph_pool_handle()
            self._held = False
        return self._handle

    def hold(self, owner: object) -> None:
        """The graphs just captured into :meth:`handle` live as long as ``owner`` does."""
        self._owners.add(owner)
        self._held = True

    def renew(self) -> None:
        """Later captures start a new pool. A failed capture calls it: the graphs it made are
        freed, and those made before into this pool stay valid."""
        self._handle = None


__all__ = ["GraphPool"]
