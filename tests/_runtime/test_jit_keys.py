"""Triton cache keys computed callees first (:mod:`trainfuse._runtime.jit_keys`): the same key in
every process, whatever it hashed first. Keys are pure Python: these run on any machine, with
real ``JITFunction`` objects (the interpreter off while the test module is imported)."""

import importlib.util
import sys

import pytest

from trainfuse._runtime import compat, jit_keys

SOURCE = '''
import triton
import triton.language as tl

import {helpers} as helpers

G = tl.constexpr(3)


@triton.jit
def leaf(x):
    return x + G


@triton.jit
def mid(x):
    return leaf(x) * helpers.H


@triton.jit
def kern(ptr, FN: tl.constexpr):
    # calls mid, and FN (a constexpr JIT function, hashed apart)
    tl.store(ptr, FN(mid(tl.load(ptr))))


@triton.jit
def other(x):
    return helpers.twice(x)
'''

HELPERS = '''
import triton
import triton.language as tl

H = tl.constexpr(5)
K = tl.constexpr(7)


@triton.jit
def twice(x):
    return x * 2 + K
'''


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A function that imports a fresh copy of the two modules and returns the kernels' module."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.syspath_prepend(str(tmp_path))
    count = iter(range(100))

    def load():
        n = next(count)
        (tmp_path / f"keys_helpers_{n}.py").write_text(HELPERS)
        (tmp_path / f"keys_kernels_{n}.py").write_text(SOURCE.format(helpers=f"keys_helpers_{n}"))
        spec = importlib.util.spec_from_file_location(f"keys_kernels_{n}", tmp_path / f"keys_kernels_{n}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        monkeypatch.delitem(sys.modules, spec.name)
        monkeypatch.delitem(sys.modules, f"keys_helpers_{n}", raising=False)
        return module

    return load


def _keys(m) -> tuple[str, ...]:
    """The four keys, those not computed yet settled first (keys computed already stay as they are:
    ``other`` read unsettled would carry Triton 3.6's own order dependence into the comparison)."""
    jit_keys.settle(m.leaf, m.mid, m.kern, m.other)
    return m.leaf.cache_key, m.mid.cache_key, m.kern.cache_key, m.other.cache_key


def test_a_kernels_key_is_the_same_whatever_was_hashed_first(fresh):
    """Callees by hand, then settle from the top, from the middle, with a constexpr function first
    (as the launcher does), and bottom-up by hand: one set of keys. (Triton up to 3.6 alone gives
    another key to ``kern`` hashed first: its callees' globals G and H left out.)"""
    by_hand = fresh()
    for fn in (by_hand.leaf, by_hand.mid, by_hand.kern, by_hand.helpers.twice, by_hand.other):
        fn.cache_key  # noqa: B018 - callees first
    expected = _keys(by_hand)
    top = fresh()
    assert compat.jit_key_pending(top.kern) and compat.jit_key_pending(top.leaf)
    jit_keys.settle(top.kern, 1, None, "x")
    assert not compat.jit_key_pending(top.leaf) and not compat.jit_key_pending(top.mid)
    assert compat.jit_key_pending(top.other)  # not called by kern: left alone
    assert _keys(top) == expected
    middle = fresh()
    jit_keys.settle(middle.mid)
    jit_keys.settle(middle.kern)
    assert _keys(middle) == expected
    constexpr_first = fresh()
    jit_keys.settle(constexpr_first.kern, constexpr_first.other)  # a kernel and its FN
    assert _keys(constexpr_first) == expected


def test_keys_follow_the_globals_they_read(fresh):
    """The settled key covers a callee's constexpr global: another value, another key."""
    a, b = fresh(), fresh()
    b.G = type(b.G)(4)
    jit_keys.settle(a.kern), jit_keys.settle(b.kern)
    assert a.leaf.cache_key != b.leaf.cache_key and a.kern.cache_key != b.kern.cache_key


def test_settle_skips_what_is_not_a_pending_jit_function(fresh):
    m = fresh()
    m.leaf.cache_key  # noqa: B018
    before = m.leaf.cache_key
    jit_keys.settle(m.leaf, 3, "name", None, m)
    assert m.leaf.cache_key == before
    assert not compat.jit_key_pending(len) and not compat.jit_key_pending(None)
