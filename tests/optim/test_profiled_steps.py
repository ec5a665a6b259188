"""A fused optimizer's step skips torch's step wrapper (a profiler range and a walk over the hook
dicts on every call) but, with the profiler on, does what that wrapper does: the step's range named
as torch names it, torch's profiler entry point (``_optimizer_step_code``, through compat) called
once inside it, and ``zero_grad``'s range named as torch names it."""

from __future__ import annotations

import pytest
import torch

import trainfuse
from trainfuse._runtime import compat
from trainfuse.amp import GradScaler


class CountingSGD(trainfuse.FusedSGD):
    """FusedSGD that counts the calls of torch's profiler entry point, and whether the profiler
    recorded each one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entry_calls = []

    def _optimizer_step_code(self):
        self.entry_calls.append(compat.profiler_enabled())


def _opt(device):
    params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in ((5, 3), (3,))]
    for p in params:
        p.grad = torch.randn_like(p)
    return CountingSGD(params, lr=0.01, momentum=0.9)


def _names(prof) -> list[str]:
    return [e.name for e in prof.function_events]


def test_an_unprofiled_step_takes_no_range_and_calls_no_profiler_entry(kernels, device):
    opt = _opt(device)
    opt.step()
    assert opt.entry_calls == []


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "with_a_step_hook"])
def test_a_profiled_step_names_its_range_as_torch_and_calls_the_entry_once(hooked, kernels, device):
    opt = _opt(device)
    calls = []
    if hooked:
        opt.register_step_post_hook(lambda *a: calls.append(a))
    with torch.autograd.profiler.profile() as prof:
        opt.step()
    assert _names(prof).count("Optimizer.step#CountingSGD.step") == 1
    assert opt.entry_calls == [True]
    assert len(calls) == int(hooked)


def test_a_profiled_scaled_step_names_its_range_and_calls_the_entry_once(kernels, device):
    opt = _opt(device)
    scaler = GradScaler(device.type, init_scale=4.0)
    scaler.scale(torch.zeros((), device=device))  # the scale tensor is made on first use
    for p in opt.param_groups[0]["params"]:
        p.grad.mul_(4.0)
    assert scaler.fused_update(opt) is not None  # the optimizer's scaled_step, not torch's two calls
    with torch.autograd.profiler.profile() as prof:
        assert scaler.step_and_update(opt) is None
    assert _names(prof).count("Optimizer.step#CountingSGD.step") == 1
    assert opt.entry_calls == [True]
    assert scaler.get_scale() == 4.0  # the step ran: no inf, no backoff


def test_zero_grad_under_the_profiler_takes_torchs_range_name(kernels, device):
    opt = _opt(device)
    with torch.autograd.profiler.profile() as prof:
        opt.zero_grad()
    assert "Optimizer.zero_grad#CountingSGD.zero_grad" in _names(prof)
    assert all(p.grad is None for p in opt.param_groups[0]["params"])
