"""FusedMuon against torch.optim.Muon: the torch path bit for bit over its hyperparameters, the
kernels (the interpreter on CPU) one step at a time from the same state within bfloat16
Newton-Schulz tolerance, the state_dict both ways, clipping inside the step, and its errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainfuse.optim.muon import FusedMuon, adjusted_scale

Muon = getattr(torch.optim, "Muon", None)
pytestmark = pytest.mark.skipif(Muon is None, reason="torch.optim.Muon needs torch 2.9 or later")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# wide, tall (Newton-Schulz on the transpose), square, a single row
SHAPES = [(8, 4), (3, 17), (16, 16), (40, 6), (1, 9)]
# The kernels' Newton-Schulz sums its bfloat16 matmuls in padded batches, in another order than
# Muon's one matrix at a time, and the quintic iteration amplifies that rounding along small
# singular directions: an element of the update may move by a few percent (test_musgd.py measured
# 2% on an H200). A weight within that times lr and its scale; the momentum takes the grads only.
NS_SHARE = 0.1
KERNEL_TOL = dict(rtol=1e-5, atol=1e-6)


def _muon_accepts(adjust_lr_fn) -> bool:
    """Whether the installed torch's Muon takes ``adjust_lr_fn`` (2.11's has no spectral_unclamped)."""
    try:
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn=adjust_lr_fn)
    except ValueError:
        return False
    return True


FNS = tuple(f for f in (None, "match_rms_adamw", "spectral_unclamped")
            if Muon is not None and _muon_accepts(f))
HPARAMS = [dict(nesterov=n, adjust_lr_fn=f, weight_decay=wd, momentum=m)
           for n, f, wd, m in itertools.product((True, False), FNS, (0.1, 0.0), (0.95, 0.3))]


def _pair(hp: dict, device=DEVICE, seed: int = 0, **extra):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=g) for s in SHAPES]
    ours = [torch.nn.Parameter(w.to(device)) for w in weights]
    theirs = [torch.nn.Parameter(w.to(device)) for w in weights]
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.05, "ns_steps": 3}]  # noqa: E731
    return (FusedMuon(groups(ours), lr=0.02, **hp, **extra), ours,
            Muon(groups(theirs), lr=0.02, **hp), theirs)


def _grads(ours, theirs, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p, q in zip(ours, theirs):
        grad = torch.randn(p.shape, generator=g).to(p.device)
        p.grad, q.grad = grad.clone(), grad.clone()


@pytest.mark.parametrize("hp", HPARAMS, ids=lambda hp: "-".join(f"{k}={v}" for k, v in hp.items()))
def test_torch_path_equals_muon_bit_for_bit(hp, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    opt, ours, ref, theirs = _pair(hp, torch.device("cpu"))
    for step in range(3):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
        for k, (p, q) in enumerate(zip(ours, theirs)):
            assert torch.equal(p, q), (step, k)
            assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"]), (step, k)


@pytest.mark.parametrize("hp", HPARAMS[::5], ids=lambda hp: "-".join(f"{k}={v}" for k, v in hp.items()))
def test_kernels_step_matches_muon_from_the_same_state(hp, kernels):
    opt, ours, ref, theirs = _pair(hp)
    for step in range(2):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
        for k, (p, q) in enumerate(zip(ours, theirs)):
            group = ref.param_groups[0 if k < 3 else 1]
            share = NS_SHARE * group["lr"] * adjusted_scale(q.shape, hp["adjust_lr_fn"])
            torch.testing.assert_close(p, q, rtol=KERNEL_TOL["rtol"], atol=KERNEL_TOL["atol"] + share,
                                       msg=f"step {step} param {k}")
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"],
                                       **KERNEL_TOL)
            with torch.no_grad():  # the next step from the same state
                p.copy_(q)
                opt.state[p]["momentum_buffer"].copy_(ref.state[q]["momentum_buffer"])


def test_kernels_step_under_a_float16_autocast_equals_the_step_outside_it(kernels):
    """A step taken inside an autocast region (a training step that calls ``opt.step()`` under
    it, or a graph that folds the step after the backward) still multiplies in bfloat16: the same
    bits as outside."""
    hp = HPARAMS[0]
    opt, ours, _, _ = _pair(hp)
    twin, theirs, _, _ = _pair(hp)
    for step in range(2):
        _grads(ours, theirs, step)
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            opt.step()
        twin.step()
        for k, (p, q) in enumerate(zip(ours, theirs)):
            assert torch.equal(p, q), (step, k)


@pytest.mark.parametrize("direction", ["muon-to-fused", "fused-to-muon"])
def test_state_dict_round_trips_with_muon(direction, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    opt, ours, ref, theirs = _pair({}, torch.device("cpu"))
    _grads(ours, theirs, 0)
    opt.step()
    ref.step()
    src, dst = (ref, opt) if direction == "muon-to-fused" else (opt, ref)
    saved = src.state_dict()
    assert saved["param_groups"][0].keys() == dst.state_dict()["param_groups"][0].keys()
    dst.load_state_dict(saved)
    _grads(ours, theirs, 1)
    opt.step()
    ref.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_max_grad_norm_equals_clipping_the_grads_before_muon(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    opt, ours, ref, theirs = _pair({}, torch.device("cpu"), max_grad_norm=0.5)
    _grads(ours, theirs, 0)
    opt.step()
    torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(adjust_lr_fn="rms"), "adjust_lr_fn must be one of"),
    (dict(ns_steps=100), r"ns_steps must be an int in \[0, 100\)"),
    (dict(lr=-1.0), "lr must be a number >= 0"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients must be three numbers"),
])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=f"FusedMuon: {match}"):
        FusedMuon([torch.nn.Parameter(torch.zeros(3, 4))], **kwargs)


def test_a_bias_is_refused_with_its_index():
    with pytest.raises(ValueError, match=r"FusedMuon: param 1 has shape \(4,\); Muon orthogonalizes"):
        FusedMuon([torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(4))])
