"""trainfuse.amp.clip_grad_norm_ and max_grad_norm= against torch (kernels through the interpreter
on CPU), with GradScaler (torch's and ours) and injected inf/NaN."""

from __future__ import annotations

import math

import pytest
import torch
import triton.language as tl

import trainfuse
from tests._helpers import INF_STEPS, set_scaled_twin_grads, twin_scalers
from trainfuse._multi_tensor import stats
from trainfuse.amp import GradScaler, clip, clip_grad_norm_

SHAPES = [(0,), (1,), (7, 13), (300,), (3, 5, 7), (130, 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORM_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _with_grads(shapes, dtype, device, scale=1.0):
    ps = [torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, device=device) * scale).to(dtype)
    return ps


def _reference(ps, max_norm, norm_type):
    """torch's clip in float64 on copies: (norm, clipped grads). Empty grads are left out of
    torch's call (its inf-norm refuses them; they change no norm), ours must take them."""
    qs = [torch.nn.Parameter(p.detach().double()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.double()
    total = torch.nn.utils.clip_grad_norm_([q for q in qs if q.numel()], max_norm, norm_type)
    return total, [q.grad for q in qs]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, "inf"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(dtype, norm_type, max_norm, kernels, device):
    ps = _with_grads(SHAPES, dtype, device)
    exp_norm, exp_grads = _reference(ps, max_norm, float(norm_type))
    norm = clip_grad_norm_(ps, max_norm, norm_type)
    assert norm.dtype == dtype and norm.dim() == 0
    torch.testing.assert_close(norm.double().cpu(), exp_norm.cpu(), rtol=NORM_TOL[dtype], atol=0)
    tol = dict(rtol=2**-7, atol=1e-5) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-7)
    for p, g in zip(ps, exp_grads):
        torch.testing.assert_close(p.grad.float().cpu(), g.to(dtype).float().cpu(), **tol)


MIXES = [(torch.float32,), (torch.bfloat16,), (torch.float16,), (torch.bfloat16, torch.float32),
         (torch.float32, torch.float16), (torch.float16, torch.bfloat16),
         (torch.bfloat16, torch.float16, torch.float32)]


@pytest.mark.parametrize("dtypes", MIXES, ids=lambda ds: "+".join(str(d)[6:] for d in ds))
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_norm_dtype_is_torchs_for_mixed_grad_dtypes(dtypes, norm_type, kernels, device):
    """Grads of several dtypes in one list: the norm comes back in the dtype torch's own function
    returns for the same list (its per-tensor norms are stacked, so the dtypes promote), its value
    within that dtype's tolerance of the float64 norm and within 2 ulps of the coarsest grad dtype
    of torch's; the grads are clipped as torch clips them in float64."""
    ps = []
    for i, shape in enumerate(SHAPES):
        ps += _with_grads([shape], dtypes[i % len(dtypes)], device)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    exact, exact_grads = _reference(ps, 0.5, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_([q for q in qs if q.numel()], 0.5, norm_type)
    norm = clip_grad_norm_(ps, 0.5, norm_type)
    assert norm.dtype == theirs.dtype and norm.dim() == 0
    torch.testing.assert_close(norm.double().cpu(), exact.cpu(), rtol=NORM_TOL[norm.dtype], atol=0)
    # torch rounds each tensor's norm to its grad's dtype and the total to the result's: up to 1.5
    # ulps of the coarsest dtype from the exact norm (0.46% for bfloat16 over 3,000 seeds); ours
    # is rounded once, half an ulp: 2 ulps apart at most, where 1e-2 is 1.3 bfloat16 ulps
    coarsest = max(dtypes, key=lambda d: torch.finfo(d).eps)
    rtol = NORM_TOL[torch.float32] if coarsest == torch.float32 else 2 * torch.finfo(coarsest).eps
    torch.testing.assert_close(norm.double().cpu(), theirs.double().cpu(), rtol=rtol, atol=0)
    for p, g in zip(ps, exact_grads):
        tol = dict(rtol=2**-7, atol=1e-5) if p.grad.dtype != torch.float32 else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p.grad.float().cpu(), g.to(p.grad.dtype).float().cpu(), **tol)


def _cached_plans():
    return [(key, id(plan)) for key, plan in clip._plans._plans.items()]


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the auto backend takes the kernels on a GPU"))])
def test_torch_backend_builds_no_plan(backend, device, monkeypatch):
    """Where torch's function runs (TRAINFUSE_BACKEND=torch, or auto on CPU) the backend is
    checked first: no device tables are built and cached for a list that will not use them."""
    monkeypatch.setenv("TRAINFUSE_BACKEND", backend)
    ps = _with_grads(SHAPES, torch.float32, device)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    before = _cached_plans()
    norm = clip_grad_norm_(ps, 0.5)
    assert _cached_plans() == before
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(qs, 0.5))
    for p, q in zip(ps, qs):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_with_nonfinite_grads_behaves_like_torch(bad, norm_type, kernels, device):
    ps = _with_grads(SHAPES, torch.float32, device)
    ps[3].grad[17] = bad
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    exp = torch.nn.utils.clip_grad_norm_([q for q in qs if q.numel()], 1.0, norm_type)
    got = clip_grad_norm_(ps, 1.0, norm_type)
    torch.testing.assert_close(got.cpu(), exp.cpu(), equal_nan=True)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), equal_nan=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(ps, 1.0, norm_type, error_if_nonfinite=True)


def test_clip_accepts_one_tensor_and_no_grads(kernels, device):
    p = torch.nn.Parameter(torch.randn(50, device=device))
    assert float(clip_grad_norm_([p], 1.0)) == 0.0  # no grads: torch returns 0
    p.grad = torch.full_like(p, 2.0)
    norm = clip_grad_norm_(p, 1.0)
    assert math.isclose(float(norm), math.sqrt(50 * 4.0), rel_tol=1e-6)
    torch.testing.assert_close(p.grad.norm(), torch.tensor(1.0, device=device), rtol=1e-5, atol=0)


def test_other_norm_types_take_torchs_function(kernels, device):
    ps = _with_grads(SHAPES, torch.float32, device)
    exp_norm, exp_grads = _reference(ps, 0.3, 3.0)
    norm = clip_grad_norm_(ps, 0.3, 3.0)
    torch.testing.assert_close(norm.double().cpu(), exp_norm.cpu(), rtol=1e-5, atol=0)
    for p, g in zip(ps, exp_grads):
        torch.testing.assert_close(p.grad.double().cpu(), g.cpu(), rtol=1e-5, atol=1e-7)


def test_reused_tables_follow_new_grads(kernels, device):
    ps = _with_grads(SHAPES, torch.float32, device)
    for _ in range(3):
        for p in ps:
            p.grad.copy_(torch.randn_like(p))
        exp_norm, exp_grads = _reference(ps, 0.7, 2.0)
        torch.testing.assert_close(clip_grad_norm_(ps, 0.7).double().cpu(), exp_norm.cpu(), rtol=1e-5, atol=0)


# ---- max_grad_norm inside the fused optimizers --------------------------------------------------
def _pair(cls, dtype, device, **hp):
    ours = _with_grads(SHAPES, dtype, device)
    theirs = [torch.nn.Parameter(p.detach().double()) for p in ours]
    tcls = {trainfuse.FusedSGD: torch.optim.SGD, trainfuse.FusedAdamW: torch.optim.AdamW}[cls]
    return ours, theirs, cls(ours, max_grad_norm=0.5, **hp), tcls(theirs, foreach=False, **hp)


@pytest.mark.parametrize("cls,hp", [(trainfuse.FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
                                    (trainfuse.FusedAdamW, dict(lr=1e-2))], ids=["sgd", "adamw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_grad_norm_is_clip_then_step(cls, hp, dtype, kernels, device):
    ours, theirs, a, b = _pair(cls, dtype, device, **hp)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = (torch.randn(p.shape, device=device) * 3).to(dtype)
            q.grad = p.grad.double()
        exp = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        a.step()
        b.step()
        torch.testing.assert_close(a.grad_norm.double().cpu(), exp.cpu(), rtol=1e-5, atol=0)
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.grad.float().cpu(), q.grad.to(dtype).float().cpu(),
                                       rtol=2**-7, atol=1e-5)
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-6, atol=1e-3)
            torch.testing.assert_close(p.detach().float().cpu(), q.detach().to(dtype).float().cpu(), **tol)
            q.data = p.detach().double()  # each step from the same point (no drift in 16 bits)
            for k, v in a.state[p].items():
                if k != "step" and torch.is_tensor(v):
                    b.state[q][k] = v.double().clone()


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "trainfuse"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_scaler_with_clipping_and_injected_inf(scaler_cls, unscale_first, kernels, device):
    """The norm is of unscaled grads, an inf skips the update (params, states, step untouched) and
    the scale backs off and grows exactly as with torch.optim.SGD + clip_grad_norm_."""
    hp = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    ours = _with_grads(SHAPES, torch.float32, device)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a = trainfuse.FusedSGD(ours, max_grad_norm=1.0, **hp)
    b = torch.optim.SGD(theirs, **hp)
    sa, sb = twin_scalers(scaler_cls, device)
    for it in range(5):
        set_scaled_twin_grads(ours, theirs, sa, sb, it, gain=4.0)
        before = [p.detach().clone() for p in ours]
        if unscale_first:
            sa.unscale_(a)
        sa.step(a)
        sa.update()
        sb.unscale_(b)
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        sb.step(b)
        sb.update()
        assert sa.get_scale() == sb.get_scale(), f"iteration {it}"
        for p, q, p0 in zip(ours, theirs, before):
            if it in INF_STEPS:
                assert torch.equal(p.detach(), p0)
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)
    assert sa.state_dict() == sb.state_dict()


def test_a_step_that_raises_after_the_scalers_check_leaves_no_check_behind(kernels, device):
    """GradScaler's check validates the grads for the step right after it. When that step raises
    (a pre-hook here), the next step validates again: grads set to None since are not read at
    their old addresses (kept alive here, so reading them would move the params)."""
    ps = _with_grads(SHAPES, torch.float32, device)
    opt = trainfuse.FusedSGD(ps, lr=0.1, max_grad_norm=1.0)
    scaler = GradScaler(device.type, init_scale=2.0)
    scaler.scale(torch.ones((), device=device))
    opt.step()  # tables built and cached

    def refuse(*args):
        raise RuntimeError("pre-hook refuses")

    handle = opt.register_step_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="pre-hook refuses"):
        scaler.step(opt)
    handle.remove()
    old = [p.grad for p in ps]
    for p in ps:
        p.grad = None
    before = [p.detach().clone() for p in ps]
    opt.step()
    for p, p0 in zip(ps, before):
        assert torch.equal(p.detach(), p0)
    assert all(g is not None for g in old)


def test_max_grad_norm_validation(device):
    p = torch.nn.Parameter(torch.randn(3, device=device))
    with pytest.raises(ValueError, match="max_grad_norm"):
        trainfuse.FusedSGD([p], lr=0.1, max_grad_norm=-1.0)


def test_norm_over_more_partials_than_one_reduction_block_is_deterministic(kernels, device, monkeypatch):
    """More work items than one block of partials (1,024; 16 under the interpreter, whose cost is
    per program): the last program's reduction loops over the partials; the result is the same
    bits every run (no float atomics)."""
    if device.type == "cpu":
        monkeypatch.setattr(stats, "PARTIALS_BLOCK", tl.constexpr(16))
    items = 2 * stats.PARTIALS_BLOCK.value + 7
    p = torch.nn.Parameter(torch.zeros(items * kernels.chunk + 5, device=device))
    g = torch.randn_like(p)
    norms = []
    for _ in range(2):
        p.grad = g.clone()
        norms.append(clip_grad_norm_([p], 1e9))
    assert torch.equal(norms[1], norms[0])
    torch.testing.assert_close(norms[0].double().cpu(), g.double().norm().cpu(), rtol=1e-6, atol=0)
