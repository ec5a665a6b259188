"""The CPU tier's faster interpreter (``tests/_interpreter.py``): installed, skipping, and kernels
built from helpers compute what torch does."""

import pytest
import torch
import triton
import triton.language as tl

from tests import _interpreter, conftest

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU machines")


@triton.jit
def _inner(x, k):
    return tl.where(x > 0, x * k, -x)


@triton.jit
def _outer(x, k):
    return _inner(x, k) + _inner(x + 1.0, k) * 0.5


@triton.jit
def _kernel(x_ptr, y_ptr, n, k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, _outer(x, k) + tl.sum(x, axis=0) * 0.0, mask=offs < n)


def _reference(x: torch.Tensor, k: float) -> torch.Tensor:
    def inner(v):
        return torch.where(v > 0, v * k, -v)

    return inner(x) + inner(x + 1.0) * 0.5


def test_installed_under_the_interpreter():
    """Fails where Triton's interpreter no longer has the names it wraps (the tier then runs at
    Triton's own speed: look at tests/_interpreter.py)."""
    from triton.runtime import interpreter

    assert conftest.INTERPRETER_KEPT
    assert getattr(interpreter._patch_lang, "trainfuse_kept", False)


@pytest.mark.parametrize("n", [0, 1, 37, 300])
def test_nested_helpers_compute_as_torch(n):
    x = torch.randn(n)
    y = torch.empty_like(x)
    _kernel[(triton.cdiv(n, 64) or 1,)](x, y, n, 3.0, BLOCK=64)
    torch.testing.assert_close(y, _reference(x, 3.0))


def test_helper_calls_skip_re_patching():
    """Each program calls three helpers (``_outer``, ``_inner`` twice): each call skips."""
    x = torch.randn(130)
    before = _interpreter.skipped
    _kernel[(3,)](x, torch.empty_like(x), 130, 2.0, BLOCK=64)
    assert _interpreter.skipped - before == 3 * 3
