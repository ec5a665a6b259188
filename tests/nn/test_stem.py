"""The space-to-depth stem: a stride-2 convolution on 3 channels computed as a stride-1 one on the
folded input, against torch's conv2d in float64 (values and the grads of input, weight and bias)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainfuse.nn import stem


@pytest.mark.parametrize("k,p", [(6, 2), (3, 1), (1, 0), (4, 1), (5, 2), (2, 0), (3, 0)])
@pytest.mark.parametrize("hw", [(8, 8), (10, 6), (2, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_folded_conv_equals_conv2d(k, p, hw, bias):
    if min(hw) + 2 * p < k:
        pytest.skip("no output")
    g = torch.Generator().manual_seed(k * 100 + p * 10 + hw[0])
    x = torch.randn(2, 3, *hw, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 3, k, k, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    ref = nn.functional.conv2d(x, w, b, stride=2, padding=p)
    out = stem.folded_conv2d(x, w, b, p)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    wanted = [x, w] + ([b] if bias else [])
    ref_grads = torch.autograd.grad(ref, wanted, grad)
    grads = torch.autograd.grad(out, wanted, grad)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r)


def test_space_to_depth_folds_two_by_two_into_padded_channels():
    x = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).view(2, 3, 4, 6)
    s = stem.space_to_depth(x, 16)
    assert s.shape == (2, 16, 2, 3) and s.is_contiguous(memory_format=torch.channels_last)
    for c in range(3):
        for dy in range(2):
            for dx in range(2):
                assert torch.equal(s[:, c * 4 + dy * 2 + dx], x[:, c, dy::2, dx::2])
    assert not s[:, 12:].any()


def test_yolov5s_stem_folds():
    assert stem.foldable(nn.Conv2d(3, 16, 6, 2, 2, bias=False)) and stem.foldable(nn.Conv2d(3, 8, 5, 2, 2))


def test_installed_on_a_stem_and_its_copies_get_the_plain_forward():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 6, 2, 2, bias=False).double()
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    ref = conv(x)
    assert stem.install(conv)
    assert not stem.install(conv)  # once
    torch.testing.assert_close(conv(x), ref)
    odd = torch.randn(1, 3, 7, 8, dtype=torch.float64)
    torch.testing.assert_close(conv(odd), nn.functional.conv2d(odd, conv.weight, None, 2, 2))  # its own
    twin = copy.deepcopy(nn.Sequential(conv))[0]
    assert "forward" not in twin.__dict__ or twin.forward.__func__ is nn.Conv2d.forward
    torch.testing.assert_close(twin(x), ref)
    stem.uninstall(conv)
    assert "forward" not in conv.__dict__


@pytest.mark.parametrize("conv", [
    nn.Conv2d(4, 4, 3, 2, 1),  # 4 channels
    nn.Conv2d(3, 4, 3, 1, 1),  # stride 1
    nn.Conv2d(3, 4, 3, 2, 1, dilation=2),
    nn.Conv2d(3, 3, 3, 2, 1, groups=3),
    nn.Conv2d(3, 4, 6, 2, 2, padding_mode="reflect"),
    nn.Conv2d(3, 4, 3, 2, 1),  # folds to 2 x 2 with uneven padding: slower than it is
], ids=["channels", "stride", "dilation", "groups", "reflect", "kernel-3"])
def test_what_it_cannot_fold_is_left_alone(conv):
    assert not stem.foldable(conv) and not stem.install(conv)
    assert "forward" not in conv.__dict__
