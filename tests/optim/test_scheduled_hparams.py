"""Hyperparameters a scheduler or warmup writes between steps: whatever torch.optim steps with,
the fused optimizers step with too, to the same result."""

from __future__ import annotations

import pytest
import torch

import trainfuse


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("dampening", [0.0, 0.2])
def test_sgd_nesterov_group_steps_as_torch_once_a_schedule_writes_momentum_zero(backend, dampening, request,
                                                                               device):
    """ultralytics' warmup with warmup_momentum=0.0 writes momentum 0 into a nesterov group; a
    scheduler may write dampening. torch checks nesterov only in its constructor."""
    if backend == "kernels":
        request.getfixturevalue("kernels")
    else:
        request.getfixturevalue("monkeypatch").setenv("TRAINFUSE_BACKEND", "torch")
    start = torch.randn(5, 3, device=device)
    ours, theirs = (torch.nn.Parameter(start.clone()) for _ in range(2))
    a = trainfuse.FusedSGD([ours], lr=0.1, momentum=0.9, nesterov=True)
    b = torch.optim.SGD([theirs], lr=0.1, momentum=0.9, nesterov=True)
    for step, (momentum, damp) in enumerate([(0.0, 0.0), (0.5, dampening), (0.9, 0.0), (0.0, dampening)]):
        for opt in (a, b):
            opt.param_groups[0]["momentum"] = momentum
            opt.param_groups[0]["dampening"] = damp
        grad = torch.randn_like(start)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step(), b.step()
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("cls", [torch.optim.SGD, trainfuse.FusedSGD])
def test_sgd_constructor_still_refuses_nesterov_without_momentum(cls):
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        cls([p], lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        cls([p], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
