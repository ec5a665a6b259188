"""ShapeCache's policy: eager at a key's first sighting, capture at its second, replay once captured;
every table bounded, failures remembered with their reason."""

from __future__ import annotations

import pytest

from trainfuse.graphs import Action, ShapeCache

EAGER, CAPTURE, REPLAY, FALLBACK = Action.EAGER, Action.CAPTURE, Action.REPLAY, Action.FALLBACK


def test_first_sighting_is_eager_second_captures_then_replays():
    cache = ShapeCache()
    assert cache.lookup("a") == (EAGER, None)
    assert cache.lookup("a") == (CAPTURE, None)
    cache.store("a", "graph a")
    assert [cache.lookup("a") for _ in range(3)] == [(REPLAY, "graph a")] * 3
    assert "a" in cache and len(cache) == 1 and cache.evictions == 0


def test_key_asks_for_capture_until_stored_or_failed():
    cache = ShapeCache()
    cache.lookup("a")
    assert [cache.lookup("a")[0] for _ in range(3)] == [CAPTURE] * 3
    assert "a" not in cache


def test_keys_are_independent():
    cache = ShapeCache()
    assert [cache.lookup(k)[0] for k in ("a", "b", "a", "b")] == [EAGER, EAGER, CAPTURE, CAPTURE]


def _captured(cache: ShapeCache, *keys: str) -> None:
    """Each key seen (eager), then captured: its graph stored as ``"graph <key>"``."""
    for key in keys:
        cache.lookup(key)
        cache.lookup(key)
        cache.store(key, f"graph {key}")


def test_store_beyond_max_graphs_drops_the_least_recently_used():
    cache = ShapeCache(max_graphs=2)
    _captured(cache, "a", "b")
    cache.lookup("a")  # a is now the most recently used: b goes first
    cache.lookup("c")
    cache.lookup("c")
    cache.store("c", "graph c")
    assert list(cache.entries()) == ["a", "c"]
    assert cache.evictions == 1
    # a dropped key starts over: eager, then capture
    assert [cache.lookup("b")[0] for _ in range(2)] == [EAGER, CAPTURE]
    cache.store("b", "graph b")
    assert list(cache.entries()) == ["c", "b"]
    assert cache.evictions == 2


def test_failed_key_falls_back_for_good_with_its_reason():
    cache = ShapeCache()
    cache.lookup("a")
    cache.lookup("a")
    cache.fail("a", "RuntimeError: operation not permitted when stream is capturing")
    assert [cache.lookup("a") for _ in range(3)] == [(FALLBACK, None)] * 3
    assert cache.reasons == {"a": "RuntimeError: operation not permitted when stream is capturing"}
    assert len(cache) == 0


def test_failed_keys_are_bounded_and_the_oldest_is_tried_again():
    cache = ShapeCache(max_eager=2)
    for key in ("a", "b", "c"):
        cache.fail(key, f"why {key}")
    assert cache.reasons == {"b": "why b", "c": "why c"}
    assert [cache.lookup("a")[0] for _ in range(2)] == [EAGER, CAPTURE]


def test_a_fallback_lookup_keeps_the_key_among_the_failed():
    cache = ShapeCache(max_eager=2)
    cache.fail("a", "why a")
    cache.fail("b", "why b")
    cache.lookup("a")  # used: b is now the oldest
    cache.fail("c", "why c")
    assert list(cache.reasons) == ["a", "c"]


def test_keys_seen_once_are_bounded():
    cache = ShapeCache(max_seen=2)
    for key in ("a", "b", "c"):
        cache.lookup(key)
    assert cache.lookup("a")[0] is EAGER  # forgotten: a first sighting again
    assert cache.lookup("c")[0] is CAPTURE


def test_storing_a_failed_key_clears_its_failure():
    cache = ShapeCache()
    cache.fail("a", "why")
    cache.store("a", "graph a")
    assert cache.lookup("a") == (REPLAY, "graph a")
    assert cache.reasons == {}


def test_forget_makes_a_key_unseen():
    cache = ShapeCache()
    cache.lookup("a")
    cache.forget("a")
    assert cache.lookup("a")[0] is EAGER
    cache.lookup("a")
    cache.store("a", "graph a")
    cache.forget("a")
    assert "a" not in cache and cache.lookup("a")[0] is EAGER


def test_clear_makes_every_key_unseen_and_keeps_counting_evictions():
    cache = ShapeCache(max_graphs=1)
    _captured(cache, "a", "b")
    cache.lookup("c")
    cache.fail("d", "why d")
    cache.clear()
    assert len(cache) == 0 and cache.reasons == {} and cache.evictions == 1
    assert [cache.lookup(k)[0] for k in ("b", "c", "d")] == [EAGER] * 3


@pytest.mark.parametrize("name", ["max_graphs", "max_seen", "max_eager"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_bounds_must_be_positive_ints(name, value):
    kwargs = {name: value}
    with pytest.raises(ValueError, match=f"ShapeCache: {name} must be a positive int"):
        ShapeCache(**kwargs)


def test_storing_none_is_refused():
    with pytest.raises(ValueError, match="entry must not be None"):
        ShapeCache().store("a", None)
