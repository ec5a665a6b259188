"""The shared client layer: optimizer swap for every registry entry, the refusals, scheduler
re-pointing, the scaler swap, cast state and report rows."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import trainfuse
from tests.optim.reference import random_hparams
from trainfuse.clients import (
    SKIPPED,
    SWAPPED,
    CastState,
    Report,
    SkipError,
    fused_scaler,
    hand_back_scaler,
    repoint_schedulers,
    swap_optimizer,
    why_not_swappable,
)
from trainfuse.optim.registry import COUNTERPARTS

ENTRIES = [c for c in COUNTERPARTS if c.stock_class is not None]


def _model(bias: bool = True) -> nn.Module:
    """Two linear layers (without biases for an optimizer of matrices only: Muon)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.ReLU(), nn.Linear(8, 3, bias=bias))


def _train(opt, model, steps=3, sched=None):
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda c: c.name)
def test_a_swapped_optimizer_continues_the_stock_one_exactly(entry, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")  # torch's own math: equality is exact
    hp = random_hparams(entry.fused_class, random.Random(0))
    ref, ours = _model(not entry.matrices), _model(not entry.matrices)
    a = entry.stock_class(ref.parameters(), **hp)
    b = entry.stock_class(ours.parameters(), **hp)
    _train(a, ref), _train(b, ours)
    assert why_not_swappable(b, kernels=False, module=ours) is None
    fused = swap_optimizer(b)
    assert type(fused) is entry.fused_class and fused.param_groups is b.param_groups
    for key in entry.attributes:  # constructor arguments kept outside defaults (MuSGD's factors)
        assert getattr(fused, key) == getattr(b, key) == hp[key], key
    _train(a, ref), _train(fused, ours)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


def test_user_group_keys_survive_and_the_fused_keys_are_added():
    model = _model()
    opt = torch.optim.SGD([{"params": model.parameters(), "tag": "all"}], lr=0.1, momentum=0.9)
    fused = swap_optimizer(opt, max_grad_norm=1.0)
    assert fused.param_groups[0]["tag"] == "all" and fused.max_grad_norm == 1.0
    assert fused.param_groups[0] is opt.param_groups[0]  # whoever holds the dict drives the new one


def _with_default(opt, key, value):
    """An optimizer with a constructor option the fused class lacks (a newer torch's, say)."""
    opt.defaults[key] = value
    return opt


@pytest.mark.parametrize("make,reason", [
    (lambda ps: torch.optim.RMSprop(ps), "RMSprop has no fused counterpart (exactly AdamW, Adam, SGD"),
    (lambda ps: type("MyAdamW", (torch.optim.AdamW,), {})(ps), "MyAdamW has no fused counterpart"),
    (lambda ps: _with_default(torch.optim.Adam(ps), "weird", 1), "option weird=1 has no FusedAdam"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, differentiable=True), "differentiable=True"),
])
def test_optimizers_the_fused_step_cannot_continue_stay(make, reason):
    opt = make(_model().parameters())
    assert reason in why_not_swappable(opt, kernels=False)


def test_step_hooks_keep_the_optimizer():
    opt = torch.optim.AdamW(_model().parameters())
    opt.register_step_post_hook(lambda *a: None)
    assert "step hooks" in why_not_swappable(opt, kernels=False)


def test_sparse_embeddings_keep_the_optimizer_before_any_step():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reason = why_not_swappable(opt, kernels=False, module=model)
    assert "0 (sparse=True) gets sparse gradients, which FusedSGD does not take" in reason
    dense = torch.optim.SGD(model[1].parameters(), lr=0.1)
    assert why_not_swappable(dense, kernels=False, module=model) is None


def test_attributes_a_copy_lost_are_refused_not_defaulted():
    """MuSGD keeps its muon/sgd factors on the object; torch's __getstate__ drops them from a deep
    copy, which would otherwise swap to the fused class's defaults silently."""
    optim = pytest.importorskip("ultralytics.optim")
    w = nn.Parameter(torch.randn(4, 4))
    stock = optim.MuSGD([{"params": [w], "use_muon": True}], lr=0.01, muon=0.2, sgd=1.0)
    assert (swap_optimizer(stock).muon, swap_optimizer(stock).sgd) == (0.2, 1.0)
    copied = copy.deepcopy(stock)
    assert "lacks muon, sgd" in why_not_swappable(copied, kernels=False)  # a client keeps it stock
    with pytest.raises(ValueError, match="no attribute 'muon', 'sgd'.*deepcopy"):
        swap_optimizer(copied)


def test_fresh_refuses_an_optimizer_with_state():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    assert why_not_swappable(opt, kernels=False, fresh=True) is None
    _train(opt, model, steps=1)
    assert "already holds state" in why_not_swappable(opt, kernels=False, fresh=True)


def test_kernel_dtypes_are_checked_only_for_the_kernels():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    assert "torch.float64 param" in why_not_swappable(opt, kernels=True)
    assert why_not_swappable(opt, kernels=False) is None


def test_schedulers_inside_sequential_lr_follow_the_swap():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2)
    decay = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_model().parameters(), lr=0.1), 1)
    fused = swap_optimizer(opt)
    assert repoint_schedulers([seq, other], opt, fused) == 1
    assert seq.optimizer is warm.optimizer is decay.optimizer is fused
    _train(fused, model, steps=4, sched=seq)  # the marked step: no "optimizer.step() before" warning
    assert fused.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


@pytest.mark.parametrize("enabled", [True, False])
def test_scaler_swap_carries_the_state_both_ways(enabled):
    old = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=3, enabled=enabled)
    new = fused_scaler(old, "cpu")
    assert isinstance(new, trainfuse.amp.GradScaler) and new.is_enabled() is enabled
    assert new.state_dict() == old.state_dict()
    if enabled:
        new.scale(torch.ones(()))
        new.update(2.0**5)
    back = hand_back_scaler(new, old)
    assert back is old and old.state_dict() == new.state_dict()


def test_scalers_that_are_not_torchs_own_stay():
    class Mine(torch.amp.GradScaler):
        pass

    assert fused_scaler(Mine("cpu"), "cpu") is None
    assert fused_scaler(trainfuse.amp.GradScaler("cpu"), "cpu") is None
    assert fused_scaler(None, "cuda") is None


def test_cast_state_saves_and_restores_float32(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = trainfuse.FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    state = CastState(model, opt, torch.bfloat16)
    assert {k for k, p in state.names.items()} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    weights = state.float32_weights()
    assert all(torch.equal(weights[k], before[k]) for k in weights)  # masters and the frozen copy
    state.restore()
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())


def test_cast_state_restore_from_weights_takes_the_16_bit_values():
    model = nn.Linear(3, 3)
    opt = trainfuse.FusedSGD(model.parameters(), lr=0.1)
    state = CastState(model, opt, torch.float16)
    with torch.no_grad():
        model.weight.fill_(0.5)
    state.restore_from_weights()
    assert model.weight.dtype == torch.float32 and bool((model.weight == 0.5).all())


def test_report_rows_and_strict():
    report = Report("Client")
    report.add("optimizer", "optimizer 0 (AdamW)", SWAPPED, "FusedAdamW")
    report.add("mlp", "body", SKIPPED, "hooks")
    text = str(report).splitlines()
    assert text[0] == "Client: 1 swapped, 1 skipped"
    assert text[1].split() == ["kind", "name", "action", "detail"]
    with pytest.raises(SkipError, match=r"Client\(strict=True\): cannot apply to mlp body: hooks"):
        Report("Client", strict=True).add("mlp", "body", SKIPPED, "hooks")
