"""Bad input: a clear error naming the param and the problem, and nothing modified."""

from __future__ import annotations

import pytest
import torch

import trainfuse
from tests.optim.reference import snapshot

OPTIMIZERS = [trainfuse.FusedAdam, trainfuse.FusedAdamW, trainfuse.FusedSGD]


def _trained(cls, device):
    params = [torch.nn.Parameter(torch.randn(5, 4, device=device)),
              torch.nn.Parameter(torch.randn(6, device=device))]
    opt = cls(params, lr=0.1, **({"momentum": 0.9} if cls is trainfuse.FusedSGD else {}))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    return params, opt


def _assert_untouched(opt, before):
    after = snapshot(opt)
    for a, b in zip(after[0], before[0]):
        assert torch.equal(a, b)
    for sa, sb in zip(after[1], before[1]):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _break_sparse(params):
    params[1].grad = torch.randn(6, device=params[1].device).to_sparse()


def _break_dtype(params):
    params[1].data = params[1].data.half()


def _break_shape(params):
    params[1].data = torch.randn(3, 2, device=params[1].device)


def _break_gaps(params):
    params[1].data = torch.randn(12, device=params[1].device)[::2]
    params[1].grad = torch.randn(6, device=params[1].device)


CASES = [
    (_break_sparse, RuntimeError, "param 1 .*sparse gradient"),
    (_break_dtype, ValueError, "param 1 .*torch.float32 gradient"),
    (_break_shape, ValueError, "param 1 .*gradient of shape \\(6,\\)"),
    (_break_gaps, ValueError, "param 1 .*gaps"),
]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("breaker,exc,match", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_bad_grad_raises_and_modifies_nothing(cls, breaker, exc, match, kernels, device):
    params, opt = _trained(cls, device)
    breaker(params)
    before = snapshot(opt)
    with pytest.raises(exc, match=f"{cls.__name__}: {match}"):
        opt.step()
    _assert_untouched(opt, before)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_complex_params_are_refused(cls):
    with pytest.raises(ValueError, match="complex"):
        cls([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))])


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "Invalid learning rate"),
    (dict(eps=-1e-8), "Invalid epsilon"),
    (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
@pytest.mark.parametrize("cls", [trainfuse.FusedAdam, trainfuse.FusedAdamW], ids=lambda c: c.__name__)
def test_bad_adam_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "Invalid learning rate"),
    (dict(momentum=-0.5), "momentum"),
    (dict(nesterov=True), "Nesterov"),
    (dict(weight_decay=-1.0), "weight_decay"),
])
def test_bad_sgd_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        trainfuse.FusedSGD([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_negative_lr_set_later_is_refused_before_the_step(kernels, device):
    params, opt = _trained(trainfuse.FusedAdamW, device)
    opt.param_groups[0]["lr"] = -0.5
    before = snapshot(opt)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    _assert_untouched(opt, before)


def test_backend_variable_is_checked(monkeypatch):
    from trainfuse._runtime.backend import backend

    monkeypatch.setenv("TRAINFUSE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="TRAINFUSE_BACKEND"):
        backend()


def test_backend_auto_runs_torch_on_cpu_and_triton_on_cuda(monkeypatch):
    from trainfuse._runtime.backend import use_triton

    monkeypatch.setenv("TRAINFUSE_BACKEND", "auto")
    assert not use_triton(torch.device("cpu"))
    assert use_triton(torch.device("cuda"))
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    assert not use_triton(torch.device("cuda"))


def test_refused_param_group_is_not_kept():
    opt = trainfuse.FusedAdamW([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": -1.0})
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))]})
    assert len(opt.param_groups) == 1
