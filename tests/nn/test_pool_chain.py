"""trainfuse.nn.pool_chain: SPPF's poolings and concatenation in one launch each way, against
torch's ``cat([y, m(y), m(m(y)), ...])`` bit for bit: values, argmax ties (the first maximum in
row-major order), NaNs, and grads, in float16, bfloat16 and float32, contiguous and channels_last,
odd sizes, maps smaller than the window. Kernels through the interpreter on CPU.

torch's CPU pooling backward adds a position's grads in the tensor's dtype, its CUDA kernel in
float32 (rounded once), which the op does: with grads whose sums are exact in 16 bits (multiples
of 1/8) the two agree with torch on CPU; with any grads the op is compared with torch's CUDA
semantics built from float32 poolings (:func:`_cuda_semantics`), and on a GPU with torch itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._helpers import cuda
from trainfuse.nn.pool_chain import max_pool_chain, max_pool_chain_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (N, C, H, W, k, n): SPPF's (k 5, n 3), odd sizes, a map smaller than the window, one channel,
# k 1 (the identity), more channels than a program's block
SHAPES = [(2, 5, 7, 6, 5, 3), (1, 3, 1, 4, 3, 1), (2, 20, 5, 5, 5, 2), (1, 1, 9, 3, 7, 3), (3, 2, 4, 4, 1, 2),
          (1, 6, 2, 2, 5, 3)]


@pytest.fixture(autouse=True)
def _kernels(kernels):
    """The Triton kernels (the interpreter on CPU)."""


def _layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _run(fn, y: torch.Tensor, g: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = y.detach().clone().requires_grad_()
    out = fn(y, k, n)
    out.backward(g)
    return out, y.grad


def _cuda_semantics(y: torch.Tensor, g: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The grad of ``y`` as torch computes it on CUDA: each pooling's backward summed in float32
    and rounded to the dtype, then added to the concatenation's slice in float32 and rounded."""
    levels = [y.detach().float().requires_grad_()]
    for _ in range(n):
        levels.append(F.max_pool2d(levels[-1], k, 1, k // 2))
    slices = g.float().chunk(n + 1, 1)
    total = slices[n]
    for j in range(n, 0, -1):
        (pooled,) = torch.autograd.grad(levels[j], levels[j - 1], total, retain_graph=True)
        total = (slices[j - 1] + pooled.to(y.dtype).float()).to(y.dtype).float()
    return total.to(y.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ties_and_exact_grads_are_torchs_bits(dtype, channels_last, shape):
    """Values from a handful of levels (ties in every window) and grads in multiples of 1/8."""
    N, C, H, W, k, n = shape
    y = _layout(torch.randint(-3, 4, (N, C, H, W)).to(dtype), channels_last).to(DEVICE)
    g = _layout((torch.randint(-8, 9, (N, (n + 1) * C, H, W)) / 8).to(dtype), channels_last).to(DEVICE)
    out, dy = _run(max_pool_chain, y, g, k, n)
    want, want_dy = _run(max_pool_chain_torch, y, g, k, n)
    assert torch.equal(out, want) and out.stride() == want.stride()
    assert torch.equal(dy, want_dy) and dy.stride() == y.stride()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_any_values_nans_and_grads_follow_torchs_cuda_kernels(dtype, channels_last):
    """Random values with NaNs and an -inf (a NaN is always the window's maximum, the last one
    where there are several), random grads: values as torch's, grads as its CUDA kernels'."""
    N, C, H, W, k, n = 2, 6, 7, 6, 5, 3
    y = torch.randn(N, C, H, W).to(dtype)
    y[0, 1, 2, 3] = y[0, 1, 2, 5] = y[1, 2, 0, 0] = float("nan")
    y[1, 2, 4, 4] = float("-inf")
    y = _layout(y, channels_last).to(DEVICE)
    g = _layout(torch.randn(N, (n + 1) * C, H, W).to(dtype), channels_last).to(DEVICE)
    out, dy = _run(max_pool_chain, y, g, k, n)
    want, _ = _run(max_pool_chain_torch, y, g, k, n)
    assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0)) and out.isnan().equal(want.isnan())
    assert torch.equal(dy, _cuda_semantics(y, g, k, n))


def test_other_inputs_take_torchs_path_and_bad_arguments_are_named():
    y = torch.randn(0, 3, 4, 4, device=DEVICE)
    assert max_pool_chain(y, 5, 3).shape == (0, 12, 4, 4)
    y64 = torch.randn(1, 2, 5, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    torch.testing.assert_close(max_pool_chain(y64, 5, 2), max_pool_chain_torch(y64, 5, 2), rtol=0, atol=0)
    strided = torch.randn(1, 3, 6, 8, device=DEVICE)[..., ::2]  # neither layout: torch's path
    assert torch.equal(max_pool_chain(strided, 3, 2), max_pool_chain_torch(strided, 3, 2))
    with pytest.raises(ValueError, match=r"max_pool_chain: y must be \(N, C, H, W\); got shape \(3, 4, 4\)"):
        max_pool_chain(torch.randn(3, 4, 4, device=DEVICE), 5, 3)
    with pytest.raises(ValueError, match="max_pool_chain: k must be an odd int from 1 to 15.*got 4"):
        max_pool_chain(torch.randn(1, 1, 4, 4, device=DEVICE), 4, 3)
    with pytest.raises(ValueError, match=r"max_pool_chain: n must be an int >= 1 .*got 0"):
        max_pool_chain(torch.randn(1, 1, 4, 4, device=DEVICE), 5, 0)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sppf_sizes_are_torchs_cuda_bits(dtype):
    """yolo11m's SPPF at batch 16 and 640 px (256 channels on a 20 x 20 map) and yolov5n's (128):
    torch's own CUDA kernels, random values and grads."""
    for channels in (256, 128):
        y = torch.randn(16, channels, 20, 20, device="cuda", dtype=dtype).contiguous(
            memory_format=torch.channels_last)
        g = torch.randn(16, 4 * channels, 20, 20, device="cuda", dtype=dtype).contiguous(
            memory_format=torch.channels_last)
        out, dy = _run(max_pool_chain, y, g, 5, 3)
        want, want_dy = _run(max_pool_chain_torch, y, g, 5, 3)
        assert torch.equal(out, want) and torch.equal(dy, want_dy)
