"""max_grad_value: torch.nn.utils.clip_grad_value_ inside the fused step, against clip_grad_value_ +
torch.optim (kernels through the interpreter on CPU; the torch path bit for bit)."""

from __future__ import annotations

import math
import random

import pytest
import torch

import trainfuse
from tests._helpers import INF_STEPS, set_scaled_twin_grads, twin_scalers
from tests.optim.reference import SHAPES, TORCH_CLASS, random_hparams
from trainfuse.amp import GradScaler

OPTIMIZERS = [trainfuse.FusedAdamW, trainfuse.FusedAdam, trainfuse.FusedSGD]
BOUND = 0.3  # no 16-bit float: a clamped 16-bit grad holds the bound rounded to its dtype
SCALE = 64.0  # a power of two, as GradScaler's: scaling and unscaling are exact
# the kernels' float32 update against torch.optim's: a few ulp a step
TOL = dict(rtol=1e-5, atol=1e-6)


def _clip_value(grads: list[torch.Tensor], bound: float) -> list[torch.Tensor]:
    """clip_grad_value_ on copies of ``grads`` (each held as the .grad of a stand-in tensor)."""
    holders = []
    for g in grads:
        h = torch.empty_like(g)
        h.grad = g.clone()
        holders.append(h)
    torch.nn.utils.clip_grad_value_(holders, bound)
    return [h.grad for h in holders]


def _pair(cls, dtype, device, bound=BOUND, **hp):
    """Ours (16-bit params keep float32 masters) and torch.optim on float32 copies (the masters)."""
    ours = [torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    a = cls(ours, max_grad_value=bound, master_weights=dtype != torch.float32, **hp)
    return ours, theirs, a, TORCH_CLASS[cls](theirs, **hp)


def _step_both(a, b, ours, theirs, grads, bound, scaled):
    """One step of each: ours on (scaled) ``grads``, torch.optim on clip_grad_value_ of them.
    Returns the clipped grads torch saw, in the grads' dtype."""
    clipped = _clip_value(grads, bound)
    for p, q, g, c in zip(ours, theirs, grads, clipped):
        p.grad = g * SCALE if scaled else g.clone()
        # a copy: torch's foreach SGD (CUDA's default) with nesterov and no weight decay adds
        # momentum * buf to the .grad it is given, in place
        q.grad = c.float().clone()
    if scaled:  # what GradScaler hands the step (test_optimizers.py checks the skipping)
        a.grad_scale = torch.tensor(SCALE, device=grads[0].device)
        a.found_inf = torch.tensor(0.0, device=grads[0].device)
    a.step()
    if scaled:
        del a.grad_scale, a.found_inf
    b.step()
    return clipped


def _conditioned_grads(theirs, dtype, hp) -> list[torch.Tensor]:
    """Random grads for the kernels' test: where an L2 weight decay (Adam's, SGD's) adds to the
    clipped grad, elements whose sum cancels to below 1e-4 of the grad are drawn again. There a
    one-ulp difference in ``weight_decay * param`` (torch's CPU add is fused, the kernel's is not)
    is the whole sum, and Adam's normalization turns it into a different update. AdamW's decay
    scales the param instead: pass no ``weight_decay`` for it. With ``maximize`` the decay adds to
    the negated grad, as torch negates it first."""
    wd = hp.get("weight_decay", 0.0)
    sign = -1.0 if hp.get("maximize", False) else 1.0
    grads = []
    for q in theirs:
        g = (torch.randn(q.shape, device=q.device) * 2 * BOUND).to(dtype)
        for _ in range(100):
            c = g.float().clamp(-BOUND, BOUND)
            bad = (sign * c + wd * q.detach()).abs() < 1e-4 * c.abs()
            if wd == 0.0 or not bad.any():
                break
            g = torch.where(bad, (torch.randn(q.shape, device=q.device) * 2 * BOUND).to(dtype), g)
        grads.append(g)
    return grads


def _weights(opt, ours):
    return [opt.state[p].get("master_param", p) for p in ours]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
def test_value_clipping_is_clip_grad_value_then_step(cls, dtype, scaled, kernels, device):
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    ours, theirs, a, b = _pair(cls, dtype, device, **hp)
    for _ in range(3):
        grads = _conditioned_grads(theirs, dtype, hp if cls is not trainfuse.FusedAdamW else {})
        clipped = _step_both(a, b, ours, theirs, grads, BOUND, scaled)
        assert sum(int((g.float().abs() > BOUND).sum()) for g in grads) > 50  # the bound bites
        for p, q, w, c in zip(ours, theirs, _weights(a, ours), clipped):
            assert torch.equal(p.grad, c)  # left clipped and unscaled in .grad, the same bits
            torch.testing.assert_close(w.detach(), q.detach(), **TOL)
            assert torch.equal(p.detach(), w.detach().to(dtype))  # the 16-bit copy of the master
    assert a.grad_norm is None  # no statistics pass ran


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
def test_torch_path_equals_clip_grad_value_then_torch_step(cls, dtype, scaled, monkeypatch, device):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    ours, theirs, a, b = _pair(cls, dtype, device, **hp)
    for _ in range(3):
        grads = [(torch.randn(p.shape, device=device) * 2 * BOUND).to(dtype) for p in ours]
        clipped = _step_both(a, b, ours, theirs, grads, BOUND, scaled)
        for p, q, w, c in zip(ours, theirs, _weights(a, ours), clipped):
            assert torch.equal(p.grad, c)
            assert torch.equal(w.detach(), q.detach())
            assert torch.equal(p.detach(), q.detach().to(dtype))


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_nan_propagates_and_infs_clamp_like_torch_clamp(cls, kernels, device):
    ours, theirs, a, b = _pair(cls, torch.float32, device, lr=0.01)
    grads = [torch.randn(p.shape, device=device) for p in ours]
    for g in grads:
        flat = g.view(-1)
        flat[: 3 * (flat.numel() // 3)].view(-1, 3)[:5] = torch.tensor([math.nan, math.inf, -math.inf])
    clipped = _step_both(a, b, ours, theirs, grads, BOUND, scaled=False)
    assert sum(int(c.isnan().sum()) for c in clipped) > 10
    for p, q, c in zip(ours, theirs, clipped):
        torch.testing.assert_close(p.grad, c, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(p.isnan(), q.isnan())
        torch.testing.assert_close(p.detach(), q.detach(), equal_nan=True, **TOL)


@pytest.mark.parametrize("cls", [trainfuse.FusedAdamW, trainfuse.FusedSGD], ids=lambda c: c.__name__)
@pytest.mark.parametrize("bound", [0.0, math.inf, 3])
def test_bounds_zero_infinite_and_integer(cls, bound, kernels, device):
    """0 zeroes every grad (weight decay alone moves the weights), inf clips nothing."""
    ours, theirs, a, b = _pair(cls, torch.float32, device, bound=bound, lr=0.01, weight_decay=0.1)
    grads = [torch.randn(p.shape, device=device) * 4 for p in ours]
    clipped = _step_both(a, b, ours, theirs, grads, bound, scaled=False)
    if bound == math.inf:
        assert all(torch.equal(c, g) for c, g in zip(clipped, grads))
    for p, q, c in zip(ours, theirs, clipped):
        assert torch.equal(p.grad, c)
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)


def test_channels_last_params_with_contiguous_grads_get_their_grads_clipped(kernels, device):
    """A grad in another memory layout than its param runs through a conformed copy: the clipped
    values still land in the user's .grad."""
    ours = [torch.nn.Parameter(torch.randn(2, 3, 5, 4, device=device).to(memory_format=torch.channels_last))
            for _ in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = trainfuse.FusedSGD(ours, lr=0.1, max_grad_value=BOUND), torch.optim.SGD(theirs, lr=0.1)
    for _ in range(2):
        grads = [torch.randn(p.shape, device=device) for p in ours]
        clipped = _step_both(a, b, ours, theirs, grads, BOUND, scaled=False)
        for p, q, c in zip(ours, theirs, clipped):
            assert p.grad.is_contiguous() and torch.equal(p.grad, c)
            torch.testing.assert_close(p.detach(), q.detach(), **TOL)


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "trainfuse"])
@pytest.mark.parametrize("cls", [trainfuse.FusedAdamW, trainfuse.FusedSGD], ids=lambda c: c.__name__)
def test_grad_scaler_skips_on_inf_and_clamps_the_unscaled_grads(scaler_cls, cls, kernels, device):
    """GradScaler's check (trainfuse's: the statistics pass, inf check only) sees the scaled grads;
    the step clamps the unscaled ones: torch.optim + unscale_ + clip_grad_value_ step for step."""
    hp = dict(lr=0.01, weight_decay=1e-2)
    ours, theirs, a, b = _pair(cls, torch.float32, device, **hp)
    sa, sb = twin_scalers(scaler_cls, device)
    for it in range(5):
        set_scaled_twin_grads(ours, theirs, sa, sb, it)
        before = [p.detach().clone() for p in ours]
        sa.step(a)
        sa.update()
        sb.unscale_(b)
        torch.nn.utils.clip_grad_value_(theirs, BOUND)
        sb.step(b)
        sb.update()
        assert sa.get_scale() == sb.get_scale(), f"iteration {it}"
        for p, q, p0 in zip(ours, theirs, before):
            if it in INF_STEPS:
                assert torch.equal(p.detach(), p0)
            else:
                assert torch.equal(p.grad, q.grad)
            torch.testing.assert_close(p.detach(), q.detach(), **TOL)
    assert a.grad_norm is None


def test_changing_max_grad_value_between_steps_takes_effect(kernels, device):
    ours, theirs, a, b = _pair(trainfuse.FusedSGD, torch.float32, device, lr=0.1, momentum=0.9)
    for bound in (BOUND, 0.1, 0.1, 2.0):
        a.max_grad_value = bound
        grads = [torch.randn(p.shape, device=device) for p in ours]
        clipped = _step_both(a, b, ours, theirs, grads, bound, scaled=False)
        for p, q, c in zip(ours, theirs, clipped):
            assert torch.equal(p.grad, c)
            torch.testing.assert_close(p.detach(), q.detach(), **TOL)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("attr", "value", "match"), [
    ("max_grad_value", -1.0, "max_grad_value must be a number >= 0"),
    ("max_grad_value", math.nan, "max_grad_value must be a number >= 0"),
    ("max_grad_norm", 1.0, "max_grad_norm=1.0 and max_grad_value=0.3 are both set"),
])
def test_bad_clipping_set_after_construction_raises_before_any_change(backend, attr, value, match,
                                                                     kernels, monkeypatch, device):
    monkeypatch.setenv("TRAINFUSE_BACKEND", backend)
    p = torch.nn.Parameter(torch.randn(70, device=device))
    opt = trainfuse.FusedAdamW([p], lr=0.1, max_grad_value=BOUND)
    p.grad = torch.randn_like(p)
    opt.step()  # tables and the bound's tensor made
    setattr(opt, attr, value)
    p.grad = torch.randn_like(p) * 4
    before, grad = p.detach().clone(), p.grad.clone()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before) and torch.equal(p.grad, grad)
    assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [-1.0, -math.inf, math.nan, "0.5", True, torch.tensor(0.5)],
                         ids=["negative", "-inf", "nan", "str", "bool", "tensor"])
def test_invalid_max_grad_value_is_refused(cls, value, device):
    p = torch.nn.Parameter(torch.randn(3, device=device))
    with pytest.raises(ValueError, match=rf"{cls.__name__}: max_grad_value must be a number >= 0.*got"):
        cls([p], lr=0.1, max_grad_value=value)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_max_grad_norm_and_max_grad_value_are_exclusive(cls, device):
    p = torch.nn.Parameter(torch.randn(3, device=device))
    with pytest.raises(ValueError, match="max_grad_norm=1.0 and max_grad_value=0.5 are both set"):
        cls([p], lr=0.1, max_grad_norm=1.0, max_grad_value=0.5)
    opt = cls([p], lr=0.1, max_grad_value=0, max_grad_norm=None)
    assert opt.max_grad_value == 0.0 and type(opt.max_grad_value) is float
