"""trainfuse.losses.bce_with_logits / BCEWithLogitsLoss against torch's
binary_cross_entropy_with_logits (in float64 where it matters): every reduction, weight and
pos_weight broadcast, dtype and target dtype, large logits, inf/NaN, empty and non-contiguous
inputs, upstream grads other than 1, retain_graph. Kernels run through the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._helpers import assert_within_ulps, spacing
from trainfuse.losses import BCEWithLogitsLoss, bce_with_logits
from trainfuse.losses import bce as bce_module

SHAPE = (6, 5, 7)  # odd sizes; 210 elements span several programs and the persistent loop
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WEIGHTS = {
    "none": lambda d: {},
    "weight-full": lambda d: {"weight": torch.rand(SHAPE, device=d)},
    "weight-per-class": lambda d: {"weight": torch.rand(7, device=d)},
    "weight-per-row": lambda d: {"weight": torch.rand(6, 1, 1, device=d)},
    "weight-middle": lambda d: {"weight": torch.rand(6, 5, 1, device=d)},
    "weight-scattered": lambda d: {"weight": torch.rand(6, 1, 7, device=d)},
    "pos_weight": lambda d: {"pos_weight": torch.rand(7, device=d) * 3},
    "both": lambda d: {"weight": torch.rand(5, 1, device=d), "pos_weight": torch.rand(7, device=d) * 3},
}


def reference(x, y, reduction, upstream, **kw):
    """torch's function in float64: (loss, grad of the logits for ``upstream``)."""
    x64 = x.detach().double().requires_grad_()
    loss = F.binary_cross_entropy_with_logits(x64, y.double(), reduction=reduction,
                                              **{k: v.double() for k, v in kw.items()})
    (g,) = torch.autograd.grad(loss, x64, upstream.double())
    return loss, g


def ours(x, y, reduction, upstream, **kw):
    x = x.detach().clone().requires_grad_()
    loss = bce_with_logits(x, y, reduction=reduction, **kw)
    (g,) = torch.autograd.grad(loss, x, upstream.to(loss.dtype))
    return loss, g


def float32_error(x, y, reduction, upstream, **kw):
    """Bounds on the error the kernels' float32 math leaves in (loss, grad of the logits), before
    any rounding to 16 bits: 16 float32 ulps of every term they add or subtract (some ten roundings
    and a 2-ulp division), and |x| more on a GPU, where exp(-|x|) is an ex2 of a rounded product.
    It matters where terms cancel: the loss x - (x - log1p(exp(x))) of a very negative logit with
    target 0, the grad s - y near s = y."""
    x, y = x.double(), y.double()
    w = kw.get("weight", torch.ones(())).double()
    pw = kw.get("pos_weight", torch.ones(())).double()
    per_ulp = (x.abs() + 16) * 2.0**-24
    loss_terms = w * (((1 - y) * x).abs() + (1 + (pw - 1) * y) * F.logsigmoid(x).abs())
    grad_terms = w * ((1 - y) * torch.sigmoid(x) + pw * y * torch.sigmoid(-x))
    inv = 1 / x.numel() if reduction == "mean" else 1
    loss_error = per_ulp * loss_terms
    if reduction != "none":  # and the float32 partial sums, x.numel() additions at most
        loss_error = inv * (loss_error.sum() + x.numel() * 2.0**-24 * loss_terms.sum())
    grad_error = per_ulp * grad_terms * inv * upstream.double().abs()
    return loss_error, grad_error


def check_rounded(got, want, dtype, error, upstream=None):
    """A result is the float32 math (``error`` off at most) rounded to ``dtype`` once: less than one
    ulp off (the interpreter truncates float32 to bfloat16; a GPU rounds to nearest, half an ulp).
    The grad of a mean or sum is rounded twice, stored in the forward and then times ``upstream``:
    the stored grad's rounding, up to one of its ulps, comes times the upstream grad (up to 2 ulps
    of the result, more for float16 grads stored among the subnormals). Over 300 seeds: at most
    0.9999 bfloat16 ulp (0.5000 float16) beyond those errors, where the distance alone reached 2.9
    ulps for a bfloat16 mean's grad and 254 where the loss cancels; float32 results use at most
    a third of ``error``."""
    if upstream is not None:
        go = upstream.double().abs()
        stored = spacing(want / go, dtype) * go
        error = error + stored
    assert_within_ulps(got, want, 1, dtype, atol=error)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weights", list(WEIGHTS), ids=str)
def test_matches_torch(dtype, reduction, weights, kernels, device):
    x = (torch.randn(SHAPE, device=device) * 4).to(dtype)
    y = (torch.rand(SHAPE, device=device) > 0.7).to(dtype)
    kw = WEIGHTS[weights](device)
    # in the loss's dtype, as autograd hands it to the backward
    upstream = torch.randn(() if reduction != "none" else SHAPE, device=device).to(dtype)
    loss, g = ours(x, y, reduction, upstream, **kw)
    want_loss, want_g = reference(x, y, reduction, upstream, **kw)
    torch_loss = F.binary_cross_entropy_with_logits(x, y, reduction=reduction, **kw)
    assert loss.dtype == torch_loss.dtype and loss.shape == torch_loss.shape
    assert g.dtype == dtype
    loss_error, grad_error = float32_error(x, y, reduction, upstream, **kw)
    check_rounded(loss, want_loss, dtype, loss_error)
    check_rounded(g, want_g, dtype, grad_error, None if reduction == "none" else upstream)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_targets_with_16bit_logits(dtype, kernels, device):
    """ultralytics passes float32 targets with fp16 logits under AMP: the loss is float32 (as
    torch returns it), the grad in the logits' dtype."""
    x = torch.randn(SHAPE, device=device).to(dtype)
    y = torch.rand(SHAPE, device=device)
    for reduction in ("mean", "none"):
        up = torch.randn(() if reduction == "mean" else SHAPE, device=device)
        loss, g = ours(x, y, reduction, up)
        want_loss, want_g = reference(x, y, reduction, up)
        assert loss.dtype == torch.float32 and g.dtype == dtype
        loss_error, grad_error = float32_error(x, y, reduction, up)
        check_rounded(loss, want_loss, torch.float32, loss_error)
        check_rounded(g, want_g, dtype, grad_error, None if reduction == "none" else up)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("weights", ["none", "both"], ids=str)
def test_float64_reductions_stay_float64(reduction, weights, kernels, device):
    """float64 logits and targets: the reduced loss (partials, their sum, the stored result) and
    the grad for an upstream grad other than 1 are torch's float64 values to 1e-12, and
    gradcheck passes (a total rounded through float32 makes its finite differences noise)."""
    x = torch.randn(SHAPE, device=device, dtype=torch.float64) * 3
    y = torch.rand(SHAPE, device=device, dtype=torch.float64)
    kw = {k: v.double() for k, v in WEIGHTS[weights](device).items()}
    upstream = torch.randn((), device=device, dtype=torch.float64)
    loss, g = ours(x, y, reduction, upstream, **kw)
    want_loss, want_g = reference(x, y, reduction, upstream, **kw)
    assert loss.dtype == g.dtype == torch.float64
    torch.testing.assert_close(loss, want_loss, atol=0, rtol=1e-12)
    # torch's grad cancels to ~1e-16 absolute where sigmoid(x) is close to 1 (see below)
    torch.testing.assert_close(g, want_g, atol=1e-14 * want_g.abs().max().item(), rtol=1e-12)

    small = {} if weights == "none" else {
        "weight": torch.rand(2, 1, device=device, dtype=torch.float64),
        "pos_weight": torch.rand(3, device=device, dtype=torch.float64) * 3}
    x_small = torch.randn(2, 3, device=device, dtype=torch.float64, requires_grad=True)
    y_small = torch.rand(2, 3, device=device, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda a: bce_with_logits(a, y_small, reduction=reduction, **small), (x_small,))


def test_large_logits_are_stable(kernels, device):
    """Finite everywhere, float32-accurate, and where the loss is only log1p(exp(-|x|)) (a
    positive logit with target 1) accurate relative to its tiny value."""
    x = torch.tensor([1e4, -1e4, 90.0, -90.0, 30.0, -30.0, 1e-3, 0.0], device=device)
    for target in (0.0, 1.0, 0.3):
        y = torch.full_like(x, target)
        up = torch.ones(x.shape, device=device)
        loss, g = ours(x, y, "none", up, pos_weight=torch.tensor(2.0, device=device))
        want_loss, want_g = reference(x, y, "none", up, pos_weight=torch.tensor(2.0, device=device))
        assert torch.isfinite(loss).all() and torch.isfinite(g).all()
        torch.testing.assert_close(loss.double(), want_loss, atol=1e-6, rtol=1e-6)
        # torch's grad formula cancels at large |x| even in float64 (2 sigmoid(30) - 2 is off by
        # ~2e-16); ours does not, so compare to within that
        torch.testing.assert_close(g.double(), want_g, atol=1e-15, rtol=1e-5)
        if target == 1.0:
            tiny = (x >= 0) & (x < 60)  # exp(-x) stays a normal float32 there
            torch.testing.assert_close(loss[tiny].double(), want_loss[tiny], atol=0, rtol=1e-5)


def test_softplus_part_is_float32_accurate(kernels, device):
    """log1p(exp(-x)), the whole loss of a positive logit with target 1, over a dense range of
    logits, relative to float64: the polynomial log1p holds float32 precision from e = 1 down to
    values where 1 + e rounds to 1. (A negative logit with target 0 computes x - (x - log1p),
    which cancels in float32 in torch's formula as in ours.)"""
    x = torch.linspace(0.0, 16.0, 4099, device=device)
    loss, _ = ours(x, torch.ones_like(x), "none", torch.ones_like(x))
    want = torch.nn.functional.softplus(-x.double())
    # exp(-x) itself is good to ~x * 6e-8 relative on the GPU (ex2 of a rounded product)
    torch.testing.assert_close(loss.double(), want, atol=0, rtol=2e-6)


def test_nan_and_inf_propagate_as_in_torch(kernels, device):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([inf, -inf, nan, 1.0, inf, -inf, 0.5], device=device)
    y = torch.tensor([0.0, 1.0, 0.0, nan, 1.0, 0.0, inf], device=device)
    for reduction in ("none", "sum"):
        up = torch.ones(() if reduction == "sum" else x.shape, device=device)
        loss, g = ours(x, y, reduction, up)
        xt = x.clone().requires_grad_()
        want = F.binary_cross_entropy_with_logits(xt, y, reduction=reduction)
        (want_g,) = torch.autograd.grad(want, xt, up)
        torch.testing.assert_close(loss, want, equal_nan=True)
        torch.testing.assert_close(g, want_g, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_inputs_give_torch_results(reduction, kernels, device):
    x = torch.empty(0, 7, device=device, requires_grad=True)
    y = torch.empty(0, 7, device=device)
    got = bce_with_logits(x, y, reduction=reduction)
    want = F.binary_cross_entropy_with_logits(x, y, reduction=reduction)
    torch.testing.assert_close(got, want, equal_nan=True)
    (g,) = torch.autograd.grad(got.sum(), x)
    assert g.shape == x.shape


def test_non_contiguous_inputs(kernels, device):
    x = torch.randn(7, 9, device=device).t()
    y = torch.rand(7, 9, device=device).t()
    pw = torch.rand(14, device=device)[::2]
    assert not x.is_contiguous() and not y.is_contiguous() and not pw.is_contiguous()
    for reduction in ("mean", "none"):
        up = torch.randn(x.shape if reduction == "none" else (), device=device)
        loss, g = ours(x, y, reduction, up, pos_weight=pw)
        want_loss, want_g = reference(x, y, reduction, up, pos_weight=pw)
        assert g.shape == x.shape
        torch.testing.assert_close(loss.double(), want_loss, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(g.double(), want_g, atol=2e-6, rtol=2e-6)


def test_input_without_grad(kernels, device):
    x, y = torch.randn(SHAPE, device=device), torch.rand(SHAPE, device=device)
    loss = bce_with_logits(x, y)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(x, y))
    with torch.no_grad():
        x.requires_grad_()
        torch.testing.assert_close(bce_with_logits(x, y, reduction="sum"),
                                   F.binary_cross_entropy_with_logits(x, y, reduction="sum"))


def test_upstream_grads_and_retain_graph(kernels, device):
    """mean/sum compute the grad in the forward and apply the upstream grad in the backward: a
    factor other than 1 (GradScaler), and a second backward through the same graph, stay right.
    (1,230 elements: the scaling's persistent loop goes round several times.)"""
    x = torch.randn(30, 41, device=device, requires_grad=True)
    y = torch.rand(30, 41, device=device)
    _, want = reference(x, y, "mean", torch.tensor(1.0))
    loss = bce_with_logits(x, y)
    (loss * 1024.0).backward(retain_graph=True)
    atol = 2e-6 * want.abs().max().item()
    torch.testing.assert_close(x.grad.double(), 1024 * want, rtol=1e-5, atol=1024 * atol)
    loss.backward()
    torch.testing.assert_close(x.grad.double(), 1025 * want, rtol=1e-5, atol=1025 * atol)


def test_none_reduction_with_sum_upstream(kernels, device):
    """ultralytics v8: bce(..., reduction="none").sum() / n; the upstream grad is an expanded
    scalar, read without materializing it."""
    x = torch.randn(SHAPE, device=device, requires_grad=True)
    y = torch.rand(SHAPE, device=device)
    (bce_with_logits(x, y, reduction="none").sum() / 3.0).backward()
    _, want = reference(x, y, "sum", torch.tensor(1 / 3.0))
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-5, atol=1e-6)


def test_reduction_is_deterministic_and_wide_offsets(kernels, device, monkeypatch):
    x = torch.randn(1000, 3, device=device)
    y = torch.rand(1000, 3, device=device)
    a = bce_with_logits(x, y, reduction="sum")
    assert torch.equal(a, bce_with_logits(x, y, reduction="sum"))
    # the 64-bit offset variant (inputs of 2**31 elements and more) on a small input
    monkeypatch.setattr(bce_module, "WIDE_FROM", 0)
    x.requires_grad_()
    b = bce_with_logits(x, y, reduction="sum")
    assert torch.equal(a, b)
    (g,) = torch.autograd.grad(b, x)
    _, want = reference(x, y, "sum", torch.tensor(1.0))
    torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-6)


def test_target_grad_takes_torchs_path(kernels, device):
    x = torch.randn(SHAPE, device=device, requires_grad=True)
    y = torch.rand(SHAPE, device=device, requires_grad=True)
    w = torch.rand(7, device=device)
    got = torch.autograd.grad(bce_with_logits(x, y, w), (x, y))
    want = torch.autograd.grad(F.binary_cross_entropy_with_logits(x, y, w), (x, y))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_module_is_a_drop_in(kernels, device):
    pw, w = torch.rand(7, device=device), torch.rand(7, device=device)
    ours_m = BCEWithLogitsLoss(weight=w, pos_weight=pw, reduction="sum")
    torch_m = torch.nn.BCEWithLogitsLoss(weight=w, pos_weight=pw, reduction="sum")
    assert isinstance(ours_m, torch.nn.BCEWithLogitsLoss)
    sd = ours_m.state_dict()
    assert sd.keys() == torch_m.state_dict().keys() == {"weight", "pos_weight"}
    torch_m.load_state_dict(sd)
    x, y = torch.randn(SHAPE, device=device), torch.rand(SHAPE, device=device)
    torch.testing.assert_close(ours_m(x, y), torch_m(x, y), rtol=1e-6, atol=1e-5)


def test_bad_inputs_raise_clear_errors(kernels, device):
    x, y = torch.randn(4, 3, device=device), torch.rand(4, 3, device=device)
    before = x.clone()
    with pytest.raises(ValueError, match=r"target size \(\(4, 2\)\) must be the same"):
        bce_with_logits(x, y[:, :2])
    with pytest.raises(ValueError, match="pos_weight of shape"):
        bce_with_logits(x, y, pos_weight=torch.ones(4, device=device))
    with pytest.raises(ValueError, match="weight of shape"):
        bce_with_logits(x, y, weight=torch.ones(2, 4, 3, device=device))
    with pytest.raises(TypeError, match="target must be a floating-point tensor"):
        bce_with_logits(x, y.long())
    with pytest.raises(ValueError, match="reduction must be one of"):
        bce_with_logits(x, y, reduction="batchmean")
    assert torch.equal(x, before)
