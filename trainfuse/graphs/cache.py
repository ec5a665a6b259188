"""When to run a step eagerly, when to capture it in a CUDA graph and when to replay: one policy per key.

A key is any hashable that changes whenever the work a step launches would (its inputs' shapes,
strides, dtypes and device, plus a caller's bucket for the Python-side state that steers it). The
policy:

- first sighting: run eagerly. The eager call doubles as the warm-up a capture needs (lazy
  initialisation, optimizer state, library workspaces happen outside the graph), and a key that
  never comes back costs no capture;
- second sighting: capture, then replay;
- captured: replay, most recently used kept, at most ``max_graphs`` graphs; the least recently used
  one is dropped (with its graph) when another is stored, and its key starts over as unseen;
- capture failed: eager from then on (:attr:`Action.FALLBACK`), with the reason kept for
  :attr:`ShapeCache.reasons`.

Every table is bounded, so a stream of one-off shapes costs bounded memory.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class Action(enum.Enum):
    """What the caller does with this call of a key."""

    EAGER = "eager"  # first sighting: run eagerly, warming up for a capture at the next one
    CAPTURE = "capture"  # second sighting: capture, then :meth:`ShapeCache.store` or :meth:`ShapeCache.fail`
    REPLAY = "replay"  # captured: replay the entry
    FALLBACK = "fallback"  # its capture failed: run eagerly, for good


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ShapeCache: {name} must be a positive int, got {value!r}")
    return value


class ShapeCache(Generic[Entry]):
    """A bounded LRU of captured entries (one CUDA graph each), with the sightings and failures that
    decide when to capture.

    Args:
        max_graphs: how many entries are kept; storing one more drops the least recently used.
        max_seen: how many keys seen once (not yet captured) are remembered; the oldest is forgotten.
        max_eager: how many keys whose capture failed are remembered as eager; the oldest is forgotten
            (and would be tried again after two more sightings).

    Example::

        cache = ShapeCache(max_graphs=2)
        cache.lookup("a")              # (Action.EAGER, None): first sighting
        cache.lookup("a")              # (Action.CAPTURE, None): capture it, then
        cache.store("a", graph)
        cache.lookup("a")              # (Action.REPLAY, graph)
    """

    def __init__(self, max_graphs: int = 8, *, max_seen: int = 64, max_eager: int = 64) -> None:
        self.max_graphs = _positive("max_graphs", max_graphs)
        self.max_seen = _positive("max_seen", max_seen)
        self.max_eager = _positive("max_eager", max_eager)
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._failed: OrderedDict[Hashable, str] = OrderedDict()
        self.evictions = 0

    def lookup(self, key: Hashable) -> tuple[Action, Entry | None]:
        """The action for this call of ``key``, and its entry where that is :attr:`Action.REPLAY`.

        Records the sighting: an unseen key comes back as :attr:`Action.EAGER` and, called again,
        as :attr:`Action.CAPTURE` (until :meth:`store` or :meth:`fail` settles it); a failed key as
        :attr:`Action.FALLBACK`.

        Args:
            key: hashable description of the call.

        Returns:
            ``(action, entry)``; ``entry`` is None unless ``action`` is :attr:`Action.REPLAY`.
        """
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return Action.REPLAY, entry
        if key in self._failed:
            self._failed.move_to_end(key)
            return Action.FALLBACK, None
        if key in self._seen:
            return Action.CAPTURE, None
        self._seen[key] = None
        if len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)
        return Action.EAGER, None

    def store(self, key: Hashable, entry: Entry) -> None:
        """Keep ``entry`` (a captured graph) for ``key``, dropping the least recently used entry if
        that makes more than ``max_graphs``; a dropped key starts over as unseen.

        Args:
            key: the key :meth:`lookup` answered :attr:`Action.CAPTURE` for.
            entry: what later lookups of ``key`` return; must not be None.
        """
        if entry is None:
            raise ValueError("ShapeCache.store: entry must not be None (None means 'not captured')")
        self.forget(key)
        self._entries[key] = entry  # newest last
        while len(self._entries) > self.max_graphs:
            self._entries.popitem(last=False)
            self.evictions += 1

    def fail(self, key: Hashable, reason: str) -> None:
        """Run ``key`` eagerly from now on, because capturing it failed for ``reason``.

        Args:
            key: the key whose capture failed.
            reason: one line saying why, kept in :attr:`reasons`.
        """
        self.forget(key)
        self._failed[key] = reason  # newest last
        if len(self._failed) > self.max_eager:
            self._failed.popitem(last=False)

    def forget(self, key: Hashable) -> None:
        """Drop everything known about ``key`` (its sighting, entry or failure): it is unseen again."""
        self._seen.pop(key, None)
        self._entries.pop(key, None)
        self._failed.pop(key, None)

    def clear(self) -> None:
        """Drop every entry, sighting and failure: all keys are unseen again. :attr:`evictions`
        goes on counting (dropping entries here is no eviction)."""
        self._entries.clear()
        self._seen.clear()
        self._failed.clear()

    @property
    def reasons(self) -> dict[Hashable, str]:
        """The keys that run eagerly because their capture failed, oldest first, with the reason."""
        return dict(self._failed)

    def entries(self) -> dict[Hashable, Entry]:
        """The captured entries, least recently used first."""
        return dict(self._entries)

    def __len__(self) -> int:
        """How many entries (graphs) are kept."""
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has a captured entry."""
        return key in self._entries


__all__ = ["Action", "ShapeCache"]
