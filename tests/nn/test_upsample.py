"""Nearest upsampling in its input's dtype (trainfuse.nn.upsample): the values of ``nn.Upsample``,
bit for bit, in the input's dtype under autocast; the backward as stock's float32 path rounds it;
what it installs on and gives back."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._helpers import cuda
from trainfuse.nn import upsample

FORMATS = [torch.contiguous_format, torch.channels_last]


def _fresh(**kwargs) -> nn.Upsample:
    kwargs = kwargs or {"scale_factor": 2}
    m = nn.Upsample(**({"mode": "nearest"} | kwargs))
    assert upsample.install(m)
    return m


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,kwargs", [
    ((2, 8, 5, 7), {"scale_factor": 2}), ((1, 3, 1, 1), {"scale_factor": 3}),
    ((0, 4, 3, 3), {"scale_factor": 2}), ((3, 5, 4, 6), {"size": (9, 13)}),
])
def test_values_and_dtype_are_the_upsamplings(fmt, dtype, shape, kwargs):
    x = torch.randn(shape).to(dtype=dtype, memory_format=fmt)
    stock = nn.Upsample(mode="nearest", **kwargs)
    ours = _fresh(**kwargs, mode="nearest")
    out = ours(x)
    assert out.dtype == dtype and torch.equal(out, stock(x))
    assert out.is_contiguous(memory_format=fmt) == stock(x).is_contiguous(memory_format=fmt)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast is off inside: the input's dtype
        assert ours(x).dtype == dtype and torch.equal(ours(x), out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_backward_rounds_once_as_the_float32_path_and_its_cast_do(fmt):
    """Stock under CUDA autocast: the float16 grads cast up, summed by the float32 upsampling's
    backward, cast down at the input's cast. Ours: summed by the float16 upsampling's backward,
    which adds in float32 and rounds once. Same bits; adding in float16 would differ here."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 6, 7, generator=g).half().to(memory_format=fmt)
    grad = (torch.randn(2, 8, 12, 14, generator=g) * torch.logspace(-3, 3, 14)).half().to(memory_format=fmt)
    up = _fresh()

    a = x.float().requires_grad_()
    F.interpolate(a, scale_factor=2, mode="nearest").backward(grad.float())
    b = x.clone().requires_grad_()
    y = up(b)
    assert y.dtype == torch.float16
    y.backward(grad)
    assert torch.equal(b.grad, a.grad.half())

    # the four grads of each input pixel added in float16, one at a time: other bits
    blocks = grad.float().unflatten(2, (6, 2)).unflatten(4, (7, 2))  # (N, C, 6, 2, 7, 2)
    naive = blocks[:, :, :, 0, :, 0].half()
    for i, j in ((0, 1), (1, 0), (1, 1)):
        naive = naive + blocks[:, :, :, i, :, j].half()
    assert not torch.equal(naive, b.grad)


def test_installs_on_plain_nearest_upsamplings_only_and_gives_back():
    plain = nn.Upsample(scale_factor=2, mode="nearest")
    assert upsample.nearest(plain) and upsample.install(plain) and upsample.installed(plain)
    assert not upsample.install(plain)  # once
    assert not upsample.install(nn.Upsample(scale_factor=2, mode="bilinear"))

    class Mine(nn.Upsample):
        pass

    assert not upsample.install(Mine(scale_factor=2, mode="nearest"))
    assert not upsample.install(nn.Identity())

    twin = copy.deepcopy(nn.Sequential(plain))[0]  # a copy (an EMA, a checkpoint) runs the class's forward
    assert not upsample.installed(twin) and twin.forward.__func__ is nn.Upsample.forward
    assert plain.state_dict() == {}
    upsample.uninstall(plain)
    assert "forward" not in plain.__dict__ and not upsample.installed(plain)
    upsample.uninstall(plain)  # nothing to give back: nothing happens


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_upsamples_in_float32_and_ours_in_the_inputs_dtype(dtype):
    """What the change rests on: CUDA autocast runs nearest upsampling in float32 (this fails if
    torch stops doing so, and the change can go)."""
    x = torch.randn(4, 16, 10, 10, device="cuda").to(dtype=dtype, memory_format=torch.channels_last)
    stock, ours = nn.Upsample(scale_factor=2, mode="nearest"), _fresh()
    with torch.autocast("cuda", dtype=dtype):
        a, b = stock(x), ours(x)
    assert a.dtype == torch.float32 and b.dtype == dtype
    assert torch.equal(a.to(dtype), b)
