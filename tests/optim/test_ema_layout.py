"""FusedEMA pairs elements, not memory positions: a model whose layout changes after the EMA was
made (ultralytics' trainer converts models to channels_last) is averaged element by element, as
ModelEMA's formula says, standalone and folded into a fused optimizer. (ultralytics 8.4's ModelEMA
itself caches the model's tensors on its first update and keeps averaging toward the old storage
after ``model.to(memory_format=...)``; FusedEMA follows the model's Parameters.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import trainfuse
from trainfuse import FusedEMA


def _conv_model(device):
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 4, 1)).to(device)


def _lerp_reference(ema_sd: dict, model_sd: dict, w: float) -> dict:
    """ModelEMA's update on logical elements, in float64."""
    return {k: torch.lerp(v.double(), model_sd[k].double(), w) for k, v in ema_sd.items()
            if v.dtype.is_floating_point}


def _assert_matches(ema: FusedEMA, expected: dict) -> None:
    for k, v in ema.ema.state_dict().items():
        if k in expected:
            torch.testing.assert_close(v.double(), expected[k], rtol=1e-6, atol=1e-6, msg=k)


def test_update_follows_a_model_made_channels_last_after_the_ema(kernels, device):
    model = _conv_model(device)
    ema = FusedEMA(model, decay=0.9, tau=1)
    ema.update(model)  # pairs and caches tables in the contiguous layout
    model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    assert not model[0].weight.is_contiguous()
    for _ in range(2):
        expected = _lerp_reference(ema.ema.state_dict(), model.state_dict(), 1 - ema.decay(ema.updates + 1))
        ema.update(model)
        _assert_matches(ema, expected)
    # the EMA tensor now has the model's layout, and the values ModelEMA would hold
    assert ema.ema[0].weight.stride() == model[0].weight.stride()


@pytest.mark.parametrize("cls", [trainfuse.FusedSGD, trainfuse.FusedAdamW], ids=["sgd", "adamw"])
def test_attached_ema_follows_a_layout_change(cls, kernels, device):
    model = _conv_model(device)
    twin = copy.deepcopy(model)
    ours, theirs = cls(model.parameters(), lr=0.05), cls(twin.parameters(), lr=0.05)
    ema_a, ema_b = FusedEMA(model, decay=0.9, tau=1), FusedEMA(twin, decay=0.9, tau=1)
    ours.attach_ema(ema_a)
    x = torch.randn(2, 3, 6, 6, device=device)
    for step in range(4):
        if step == 2:
            model.to(memory_format=torch.channels_last)
            twin.to(memory_format=torch.channels_last)
        for m, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            m(x.contiguous(memory_format=torch.channels_last) if step >= 2 else x).square().mean().backward()
        ours.step()
        theirs.step()
        ema_b.update(twin)
    for (k, a), b in zip(ema_a.ema.state_dict().items(), ema_b.ema.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
