"""The Triton helpers FusedMLP shares with the losses and the multi-tensor kernels, from
``trainfuse._runtime``: the bf16 round-to-nearest-even (``rounding.py``) and the one-launch
deterministic sum (``reduce.py``), run through the interpreter on CPU against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from trainfuse._multi_tensor import kernels as mt
from trainfuse._multi_tensor import stats as mt_stats
from trainfuse._runtime import reduce, rounding
from trainfuse._runtime.backend import interpreting
from trainfuse.losses import _common, bce, iou
from trainfuse.nn.mlp import kernels as mlp_kernels

# float32 bit patterns: ties between two bf16 values (to even: down, then up, and negative),
# the largest float32 (rounds to inf), bf16's largest finite, infinities, zeros, a subnormal, and
# NaNs whose payload lies in the high bits, only in the low 16 bits (0x7F800001: truncated, an
# infinity) or everywhere (adding the rounding bias would carry into the sign)
_SPECIAL = [0x3F808000, 0x3F818000, 0xBF818000, 0x7F7FFFFF, 0x7F7F0000, 0x7F800000, 0xFF800000,
            0x00000000, 0x80000000, 0x00018000, 0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF]


def _inputs(device, subnormal: bool = True) -> torch.Tensor:
    special = torch.from_numpy(np.array(_SPECIAL, dtype=np.uint32).view(np.float32))
    spread = torch.randn(1000) * torch.logspace(-40 if subnormal else -37, 38, 1000)
    x = torch.cat([special, spread])
    if not subnormal:
        x = x[~((x != 0) & (x.abs() < torch.finfo(torch.float32).tiny))]
    return x.to(device)


def _check_like_torch(got: torch.Tensor, x: torch.Tensor) -> None:
    """``got`` (bfloat16, or float32 holding bfloat16 values) has the bits of torch's rounding of
    ``x``; NaN where ``x`` is NaN."""
    want = x.to(torch.bfloat16).to(got.dtype)
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(got), nan), x[torch.isnan(got) != nan]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, rounding.round_bf16_rne(x), mask=offs < n)


@triton.jit
def _mlp_store_kernel(x_ptr, y_ptr, n, RNE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, mlp_kernels.to_dtype(x, tl.bfloat16, RNE), mask=offs < n)


@triton.jit
def _multi_tensor_store_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mt.store(y_ptr, offs, n, tl.load(x_ptr + offs, mask=offs < n), True)


def test_bf16_rounding_ties_to_even_and_keeps_nan_as_torch(device):
    """round_bf16_rne gives the float32 value of torch's float32 -> bfloat16 rounding, bit for
    bit: ties to even, overflow to inf, subnormals; every NaN stays NaN. The inputs include values
    where truncation (the interpreter's own conversion) differs, so a missing rounding fails."""
    x = _inputs(device)
    n = x.numel()
    truncated = (x.view(torch.int32) >> 16).to(torch.int16)
    finite = torch.isfinite(x)
    assert (truncated[finite] != x[finite].to(torch.bfloat16).view(torch.int16)).any()
    y = torch.empty(n, device=device)
    _round_kernel[(1,)](x, y, n, BLOCK=triton.next_power_of_2(n))
    _check_like_torch(y, x)


@pytest.mark.parametrize("store", ["mlp", "multi_tensor"])
def test_bf16_stores_of_mlp_and_multi_tensor_kernels_round_as_torch(store, device):
    """FusedMLP's stores (with RNE under the interpreter, as its launches pass it) and the
    multi-tensor kernels' stores write torch's bfloat16 bits, NaN kept. No subnormal results: the
    interpreter's own float32 -> bfloat16 conversion, which the stores end with, garbles those."""
    x = _inputs(device, subnormal=False)
    n = x.numel()
    y = torch.empty(n, dtype=torch.bfloat16, device=device)
    block = triton.next_power_of_2(n)
    if store == "mlp":
        _mlp_store_kernel[(1,)](x, y, n, RNE=interpreting(), BLOCK=block)
    else:
        _multi_tensor_store_kernel[(1,)](x, y, n, BLOCK=block)
    _check_like_torch(y, x)


@triton.jit
def _sum_kernel(x_ptr, partials, counter, out, denom):
    part = tl.load(x_ptr + tl.program_id(0))
    reduce.reduce_partials(partials, counter, out, part, tl.num_programs(0), denom)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("programs", [1, 7, 1100], ids=lambda n: f"{n}_programs")
def test_reduce_partials_sums_every_program_once_and_rearms(device, programs, out_dtype):
    """One partial per program, summed by the last to arrive (1100 programs: past one 1024-wide
    pass) and divided by ``denom``: integer partials make the float64 sum exact, so a float32
    result equals torch's bit for bit and a float64 one is within one ulp (Triton's float64
    division on an H200 is not always correctly rounded); the counter is back at zero, and a
    second launch agrees."""
    x = torch.randint(-1000, 1000, (programs,), device=device).float()
    partials = torch.full((programs,), float("nan"), device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    want = (x.double().sum() / 3.0).to(out_dtype)
    for _ in range(2):
        out = torch.full((), float("nan"), dtype=out_dtype, device=device)
        _sum_kernel[(programs,)](x, partials, counter, out, 3.0)
        if out_dtype == torch.float64:
            torch.testing.assert_close(out, want, rtol=2.3e-16, atol=0)
        else:
            assert torch.equal(out, want)
        assert int(counter) == 0


def test_the_helpers_are_defined_once():
    """Every kernel family calls the one copy in trainfuse._runtime."""
    assert mlp_kernels.round_bf16_rne is mt.round_bf16_rne is rounding.round_bf16_rne
    assert bce.reduce_partials is iou.reduce_partials is reduce.reduce_partials
    assert mlp_kernels.last_to_arrive is mt_stats.last_to_arrive is reduce.last_to_arrive
    assert not hasattr(_common, "reduce_partials")
