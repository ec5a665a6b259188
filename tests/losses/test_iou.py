"""trainfuse.losses.bbox_iou / iou_loss against ultralytics' bbox_iou and a float64 torch
reference: values and grads, every variant and box format, degenerate boxes, broadcasting, 16-bit
and mixed dtypes, reductions, errors. Kernels run through the interpreter on CPU."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from trainfuse.losses import BboxIoU, IoULoss, bbox_iou, iou_loss
from trainfuse.losses import iou as iou_module
from trainfuse.losses.iou import atan, bbox_iou_reference, iou_loss_reference

metrics = pytest.importorskip("ultralytics.utils.metrics")

VARIANTS = [{}, {"GIoU": True}, {"DIoU": True}, {"CIoU": True}]
IDS = ["iou", "giou", "diou", "ciou"]
INF, NAN = float("inf"), float("nan")
# (box1, box2) in xyxy: identical, touching, disjoint, nested, zero-area, same corner, partial
DEGENERATE = [
    ([0, 0, 2, 2], [0, 0, 2, 2]),
    ([0, 0, 2, 2], [2, 0, 4, 2]),
    ([0, 0, 2, 2], [0, 2, 2, 4]),
    ([0, 0, 2, 2], [5, 5, 6, 7]),
    ([0, 0, 4, 4], [1, 1, 2, 3]),
    ([0, 0, 0, 0], [0, 0, 0, 0]),
    ([1, 1, 1, 3], [0, 0, 2, 2]),
    ([0, 0, 2, 2], [0, 0, 3, 1]),
    ([0, 0, 2, 2], [1, 1, 3, 3]),
]


def random_boxes(n, xywh, device, dtype=torch.float64):
    xy = torch.rand(n, 2, device=device, dtype=torch.float64) * 20
    wh = torch.rand(n, 2, device=device, dtype=torch.float64) * 8 + 0.05
    b = torch.cat([xy + wh / 2, wh], 1) if xywh else torch.cat([xy, xy + wh], 1)
    return b.to(dtype)


def degenerate_boxes(xywh, device):
    b1 = torch.tensor([p[0] for p in DEGENERATE], dtype=torch.float64, device=device)
    b2 = torch.tensor([p[1] for p in DEGENERATE], dtype=torch.float64, device=device)
    if xywh:  # same boxes, as centre and size
        b1, b2 = (torch.cat([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2]], 1) for b in (b1, b2))
    return b1, b2


def values_and_grads(fn, b1, b2, upstream, **kw):
    a = b1.detach().clone().requires_grad_()
    b = b2.detach().clone().requires_grad_()
    out = fn(a, b, **kw)
    ga, gb = torch.autograd.grad(out, (a, b), upstream.to(out.dtype))
    return out, ga, gb


def assert_close(got, want, atol, rtol=0.0):
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("flags", VARIANTS, ids=IDS)
@pytest.mark.parametrize("xywh", [False, True], ids=["xyxy", "xywh"])
def test_bbox_iou_matches_ultralytics_float64(flags, xywh, kernels, device):
    """Random and degenerate pairs (identical, touching, disjoint, nested, zero-area): the kernel
    in float64 equals ultralytics' bbox_iou in float64, values and grads (a tie in min/max splits
    the grad as torch does; at touching boxes clamp(0) passes the grad as this torch's does)."""
    r1, r2 = random_boxes(37, xywh, device), random_boxes(37, xywh, device)
    d1, d2 = degenerate_boxes(xywh, device)
    b1, b2 = torch.cat([r1, d1]), torch.cat([r2, d2])
    up = torch.randn(len(b1), 1, device=device, dtype=torch.float64)
    got = values_and_grads(bbox_iou, b1, b2, up, xywh=xywh, **flags)
    want = values_and_grads(metrics.bbox_iou, b1, b2, up, xywh=xywh, **flags)
    # float64 math with float64 constants and a float64 atan: rounding-level differences only
    for g, w in zip(got, want):
        assert_close(g, w, atol=1e-12 * max(1.0, w.abs().max().item()), rtol=1e-12)
    assert got[0].shape == want[0].shape == (len(b1), 1)


def extreme_box_pairs(n, xywh, device):
    """Pairs of boxes of aspect ratio w / h from 1e-9 to 1e9 (atan's argument tiny, around the
    reduction's break points tan(pi/8), 1, tan(3pi/8), and huge), one size per pair from 1e-3 to
    3 (unions down to a few eps, where eps's float64 value shows), centres a quarter of that size
    apart at most, so that most pairs overlap."""
    ratios = torch.cat([torch.logspace(-9, 9, n - 6, dtype=torch.float64),
                        torch.tensor([math.tan(math.pi / 8), math.tan(3 * math.pi / 8)],
                                     dtype=torch.float64).repeat_interleave(3)
                        * torch.tensor([1 - 1e-12, 1.0, 1 + 1e-12], dtype=torch.float64).repeat(2)])
    size = 10 ** (torch.rand(n, 1, device=device, dtype=torch.float64) * 3.5 - 3)

    def boxes():
        r = ratios[torch.randperm(n)].to(device).unsqueeze(1)
        wh = torch.cat([r.sqrt(), 1 / r.sqrt()], 1) * size
        xy = torch.rand(n, 2, device=device, dtype=torch.float64) * size / 4
        return torch.cat([xy, wh], 1) if xywh else torch.cat([xy - wh / 2, xy + wh / 2], 1)

    return boxes(), boxes()


@pytest.mark.parametrize("xywh", [False, True], ids=["xyxy", "xywh"])
def test_ciou_float64_matches_ultralytics_to_1e12(xywh, kernels, device):
    """CIoU in float64 is ultralytics' float64 value and grads to 1e-12, extreme aspect ratios and
    tiny boxes included: the float64 kernel's atan, constants and eps are float64-exact."""
    e1, e2 = extreme_box_pairs(40, xywh, device)
    b1 = torch.cat([e1, random_boxes(20, xywh, device)])
    b2 = torch.cat([e2, random_boxes(20, xywh, device)])
    up = torch.randn(len(b1), 1, device=device, dtype=torch.float64)
    got = values_and_grads(bbox_iou, b1, b2, up, xywh=xywh, CIoU=True)
    want = values_and_grads(metrics.bbox_iou, b1, b2, up, xywh=xywh, CIoU=True)
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        assert_close(g, w, atol=1e-12 * max(1.0, w.abs().max().item()), rtol=1e-12)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind", ["giou", "ciou"])
def test_iou_loss_float64_reductions_stay_float64(reduction, kind, kernels, device):
    """float64 boxes: the weighted, reduced loss (partials, their sum, the stored result) and the
    grads of both boxes are ultralytics' float64 values to 1e-12; gradcheck passes for GIoU (a
    total rounded through float32 makes its finite differences noise)."""
    pred, target = random_boxes(23, False, device), random_boxes(23, False, device)
    w = torch.rand(23, 1, device=device, dtype=torch.float64)
    up = torch.randn((), device=device, dtype=torch.float64)

    def ultralytics_loss(a, b):
        loss = (1.0 - metrics.bbox_iou(a, b, xywh=False, GIoU=kind == "giou", CIoU=kind == "ciou")) * w
        return loss.sum() if reduction == "sum" else loss.mean()

    got = values_and_grads(iou_loss, pred, target, up, weight=w, kind=kind, reduction=reduction)
    want = values_and_grads(ultralytics_loss, pred, target, up)
    for g, r in zip(got, want):
        assert g.dtype == torch.float64
        assert_close(g, r, atol=1e-12 * r.abs().max().item(), rtol=1e-12)
    if kind == "giou":  # CIoU's alpha is a constant in backward: its grad is not its derivative
        b1 = random_boxes(5, False, device).requires_grad_()
        b2 = (b1.detach() + torch.rand(5, 4, device=device, dtype=torch.float64)).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda a, b: iou_loss(a, b, w[:5], kind="giou", reduction=reduction), (b1, b2))


@pytest.mark.parametrize("flags", VARIANTS, ids=IDS)
@pytest.mark.parametrize("xywh", [False, True], ids=["xyxy", "xywh"])
def test_bbox_iou_float32_matches_ultralytics(flags, xywh, kernels, device):
    b1, b2 = random_boxes(50, xywh, device, torch.float32), random_boxes(50, xywh, device, torch.float32)
    up = torch.randn(50, 1, device=device)
    got = values_and_grads(bbox_iou, b1, b2, up, xywh=xywh, **flags)
    ref = values_and_grads(metrics.bbox_iou, b1, b2, up, xywh=xywh, **flags)
    exact = values_and_grads(metrics.bbox_iou, b1.double(), b2.double(), up.double(), xywh=xywh, **flags)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for g, r, e in zip(got, ref, exact):
        assert_close(g, r, atol=2e-5, rtol=1e-4)
        # no further from the float64 truth than ultralytics' own float32 result, give or take
        assert (g.double() - e).abs().max() <= 4 * (r.double() - e).abs().max() + 1e-6


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp16-fp32", "bf16-fp32", "fp16", "bf16"])
def test_16bit_and_mixed_inputs(dtypes, kernels, device):
    """The AMP case: fp16/bf16 predictions against fp32 targets. Math in float32, so the result is
    the float64 value of the (rounded) inputs to float32 precision; grads in each input's dtype."""
    d1, d2 = dtypes
    b1, b2 = random_boxes(40, False, device, d1), random_boxes(40, False, device, d2)
    up = torch.randn(40, 1, device=device)
    out, g1, g2 = values_and_grads(bbox_iou, b1, b2, up, xywh=False, CIoU=True)
    ref = values_and_grads(bbox_iou_reference, b1.double(), b2.double(), up.double(), xywh=False,
                           CIoU=True)
    assert out.dtype == torch.result_type(b1, b2)
    assert (g1.dtype, g2.dtype) == (d1, d2)
    out_tol = 1e-5 if out.dtype == torch.float32 else 4 * torch.finfo(out.dtype).eps
    assert_close(out, ref[0], atol=out_tol, rtol=out_tol)
    # ultralytics' formula in float32 on the same (rounded) boxes: some pairs are ill-conditioned
    # enough that float32 math itself loses ~8 ulp of the largest grad there
    ref32 = values_and_grads(metrics.bbox_iou, b1.float(), b2.float(), up, xywh=False, CIoU=True)
    for g, r, r32 in zip((g1, g2), ref[1:], ref32[1:]):
        tol = 4 * torch.finfo(g.dtype).eps
        atol = tol * r.abs().max().item()
        if g.dtype == torch.float32:
            atol = max(atol, 2 * (r32.double() - r).abs().max().item())
        assert_close(g, r, atol=atol, rtol=tol)


@pytest.mark.parametrize("shapes", [((5, 1, 4), (1, 7, 4)), ((4,), (6, 4)), ((2, 3, 4), (3, 4)),
                                    ((3, 1, 2, 4), (3, 2, 4))], ids=str)
def test_broadcasting_matches_ultralytics(shapes, kernels, device):
    s1, s2 = shapes
    b1 = random_boxes(math.prod(s1[:-1]), True, device).reshape(s1)
    b2 = random_boxes(math.prod(s2[:-1]), True, device).reshape(s2)
    out_shape = metrics.bbox_iou(b1, b2, CIoU=True).shape
    up = torch.randn(out_shape, device=device, dtype=torch.float64)
    got = values_and_grads(bbox_iou, b1, b2, up, CIoU=True)
    want = values_and_grads(metrics.bbox_iou, b1, b2, up, CIoU=True)
    assert got[0].shape == out_shape
    assert got[1].shape == b1.shape and got[2].shape == b2.shape
    for g, w in zip(got, want):
        assert_close(g, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("flags", VARIANTS, ids=IDS)
def test_nan_and_inf_propagate_as_in_torch(flags, kernels, device):
    b1 = torch.tensor([[NAN, 0, 2, 2], [0, 0, INF, 2], [0, 0, 2, 2], [-INF, 0, 2, 2], [0, 0, 2, NAN]],
                      dtype=torch.float64, device=device)
    b2 = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, NAN, 1], [0, 0, 1, 1], [0, 0, 1, 1]],
                      dtype=torch.float64, device=device)
    up = torch.ones(5, 1, device=device, dtype=torch.float64)
    got = values_and_grads(bbox_iou, b1, b2, up, xywh=False, **flags)
    want = values_and_grads(metrics.bbox_iou, b1, b2, up, xywh=False, **flags)
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan())
        assert_close(g, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("at_zero", [True, False], ids=["torch-2.11", "torch-2.15"])
def test_touching_boxes_follow_either_clamp_convention(at_zero, kernels, device, monkeypatch):
    """Where boxes touch, the intersection width is exactly 0 and clamp(0)'s grad there depends on
    the torch version (2.11 passes it, 2.15 does not). The installed torch exercises one branch
    above; both are checked here against a reference with that clamp written out."""
    monkeypatch.setattr(iou_module, "_clamp_at_zero", lambda: at_zero)
    eps = 1e-7

    def clamp0(x):  # clamp(0) whose grad passes at exactly 0 or not
        return x * ((x >= 0) if at_zero else (x > 0)).to(x.dtype)

    def reference(a, b):
        x1, y1, x2, y2 = a.unbind(-1)
        X1, Y1, X2, Y2 = b.unbind(-1)
        inter = clamp0(x2.minimum(X2) - x1.maximum(X1)) * clamp0(y2.minimum(Y2) - y1.maximum(Y1))
        union = (x2 - x1) * (y2 - y1 + eps) + (X2 - X1) * (Y2 - Y1 + eps) - inter + eps
        return (inter / union).unsqueeze(-1)

    b1 = torch.tensor([[0, 0, 2, 2]] * 4, dtype=torch.float64, device=device)
    b2 = torch.tensor([[2, 0, 4, 2], [0, 2, 2, 4], [2, 2, 3, 3], [1, 1, 3, 3]], dtype=torch.float64,
                      device=device)
    up = torch.randn(4, 1, device=device, dtype=torch.float64)
    got = values_and_grads(bbox_iou, b1, b2, up, xywh=False)
    want = values_and_grads(reference, b1, b2, up)
    for g, w in zip(got, want):
        assert_close(g, w, atol=1e-9, rtol=1e-9)
    assert (got[1][:3] != 0).any() == at_zero  # the touching rows get a grad only at_zero


@pytest.mark.parametrize("flags", VARIANTS[:3], ids=IDS[:3])
def test_gradcheck_float64(flags, kernels, device):
    """IoU, GIoU, DIoU are smooth away from ties: finite differences of the kernel's own forward
    agree with its backward. (CIoU treats alpha as a constant in backward, like ultralytics, so its
    grad is not the derivative of its value; it is checked against the reference above.)"""
    b1 = random_boxes(6, False, device).requires_grad_()
    b2 = (b1.detach() + torch.rand(6, 4, device=device, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: bbox_iou(a, b, xywh=False, **flags), (b1, b2),
                                    eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("weight_shape", [None, (23, 1), (23,), (1,)], ids=str)
@pytest.mark.parametrize("kind", ["ciou", "giou"])
def test_iou_loss_matches_reference(reduction, weight_shape, kind, kernels, device):
    """reduce(weight * (1 - IoU)) with the weighting and reduction in the kernel, against the
    float64 reference; an (n,) weight is one weight per box."""
    pred = random_boxes(23, False, device, torch.float32)
    target = random_boxes(23, False, device, torch.float32)
    w = None if weight_shape is None else torch.rand(weight_shape, device=device)
    p = pred.clone().requires_grad_()
    out = iou_loss(p, target, w, kind=kind, reduction=reduction)
    up = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, p, up)
    pr = pred.double().requires_grad_()
    wr = None if w is None else (w.double().unsqueeze(-1) if weight_shape == (23,) else w.double())
    ref = iou_loss_reference(pr, target.double(), wr, kind=kind, reduction=reduction)
    (gr,) = torch.autograd.grad(ref, pr, up.double())
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close(g, gr, atol=1e-5, rtol=1e-5)


def test_iou_loss_is_ultralytics_bbox_loss(kernels, device):
    """BboxLoss: ((1 - bbox_iou(pred, target, xywh=False, CIoU=True)) * weight).sum() / tss, with
    an fp16 prediction against fp32 targets (AMP); grads of both boxes."""
    pred = random_boxes(31, False, device, torch.float16).requires_grad_()
    target = random_boxes(31, False, device, torch.float32).requires_grad_()
    weight = torch.rand(31, 1, device=device)
    tss = 7.5
    loss = iou_loss(pred, target, weight, kind="ciou", reduction="sum") / tss
    grads = torch.autograd.grad(loss, (pred, target))
    p64, t64 = pred.detach().double().requires_grad_(), target.detach().double().requires_grad_()
    ref = ((1.0 - metrics.bbox_iou(p64, t64, xywh=False, CIoU=True)) * weight.double()).sum() / tss
    refg = torch.autograd.grad(ref, (p64, t64))
    assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert grads[0].dtype == torch.float16 and grads[1].dtype == torch.float32
    assert_close(grads[0], refg[0], atol=2e-3 * refg[0].abs().max().item(), rtol=2e-3)
    assert_close(grads[1], refg[1], atol=1e-5, rtol=1e-5)


def test_iou_loss_reduction_is_deterministic(kernels, device):
    pred, target = random_boxes(3001, False, device, torch.float32), random_boxes(3001, False, device,
                                                                                  torch.float32)
    a = iou_loss(pred, target, reduction="sum")
    b = iou_loss(pred, target, reduction="sum")
    assert torch.equal(a, b)
    assert_close(a, iou_loss_reference(pred.double(), target.double()), atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_empty_inputs_give_torch_results(reduction, kernels, device):
    pred = torch.empty(0, 4, device=device, requires_grad=True)
    target = torch.empty(0, 4, device=device)
    out = iou_loss(pred, target, reduction=reduction)
    ref = iou_loss_reference(pred, target, reduction=reduction)
    assert out.shape == ref.shape
    assert_close(out, ref, atol=0)
    (g,) = torch.autograd.grad(out.sum(), pred)
    assert g.shape == (0, 4)
    assert bbox_iou(pred, target).shape == (0, 1)


def test_non_contiguous_and_no_grad_inputs(kernels, device):
    base = torch.cat([random_boxes(40, True, device, torch.float32)] * 2, 1)  # (40, 8)
    b1 = base[:, 2:6]  # rows 8 apart: not contiguous
    b2 = random_boxes(40, True, device, torch.float32).t().contiguous().t()
    assert not b1.is_contiguous() and not b2.is_contiguous()
    with torch.no_grad():
        out = bbox_iou(b1, b2, CIoU=True)
    assert not out.requires_grad
    assert_close(out, metrics.bbox_iou(b1.double(), b2.double(), CIoU=True), atol=1e-5, rtol=1e-5)
    leaf = b1.clone().requires_grad_()  # only box1 needs a grad
    (g,) = torch.autograd.grad(bbox_iou(leaf, b2, CIoU=True).sum(), leaf)
    p = b1.double().requires_grad_()
    (gr,) = torch.autograd.grad(metrics.bbox_iou(p, b2.double(), CIoU=True).sum(), p)
    assert_close(g, gr, atol=1e-5, rtol=1e-5)


def test_retain_graph_and_upstream_scale(kernels, device):
    pred = random_boxes(20, False, device, torch.float32).requires_grad_()
    target = random_boxes(20, False, device, torch.float32)
    loss = iou_loss(pred, target, reduction="mean")
    (loss * 3).backward(retain_graph=True)
    first = pred.grad.clone()
    loss.backward()
    p = pred.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(iou_loss_reference(p, target.double(), reduction="mean"), p)
    assert_close(first, 3 * gr, atol=1e-6, rtol=1e-5)
    assert_close(pred.grad, 4 * gr, atol=1e-6, rtol=1e-5)


def test_modules(kernels, device):
    b1, b2 = random_boxes(9, True, device, torch.float32), random_boxes(9, True, device, torch.float32)
    assert torch.equal(BboxIoU(CIoU=True)(b1, b2), bbox_iou(b1, b2, CIoU=True))
    w = torch.rand(9, 1, device=device)
    assert torch.equal(IoULoss("diou", xywh=True, reduction="mean")(b1, b2, w),
                       iou_loss(b1, b2, w, "diou", True, "mean"))
    assert "CIoU" in repr(BboxIoU(CIoU=True)) and "diou" in repr(IoULoss("diou"))


def test_bad_inputs_raise_clear_errors(kernels, device):
    b = random_boxes(4, False, device, torch.float32)
    before = b.clone()
    with pytest.raises(ValueError, match="4 values in its last dimension"):
        bbox_iou(b[:, :3], b)
    with pytest.raises(TypeError, match="box2 must be a floating-point tensor"):
        bbox_iou(b, b.long())
    with pytest.raises(ValueError, match="do not broadcast"):
        bbox_iou(b, b[:3])
    with pytest.raises(ValueError, match="kind must be one of"):
        iou_loss(b, b, kind="eiou")
    with pytest.raises(ValueError, match="reduction must be one of"):
        iou_loss(b, b, reduction="max")
    with pytest.raises(ValueError, match="weight of shape"):
        iou_loss(b, b, torch.ones(3, device=device))
    with pytest.raises(TypeError, match="box1 must be a Tensor"):
        bbox_iou(b.tolist(), b)
    assert torch.equal(b, before)


@triton.jit
def _atan_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, atan(x), mask=offs < n)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6),
                                        (torch.float64, 2 * torch.finfo(torch.float64).eps)], ids=str)
def test_atan_accuracy(dtype, rtol, device):
    """The polynomial atan (what lets one kernel run under the interpreter): relative error within
    float32 precision of torch's float64 atan, and within 2 ulp in float64, over the whole range
    (the reduction's break points included); exact limits at +-inf, NaN stays NaN."""
    decades = 0.8 * math.log10(torch.finfo(dtype).max)  # clear of subnormals (flushed on a GPU)
    x = torch.cat([torch.logspace(-decades, decades, 2000, dtype=torch.float64),
                   torch.linspace(0, 5, 2001, dtype=torch.float64),
                   torch.tensor([math.tan(math.pi / 8), math.tan(3 * math.pi / 8)], dtype=torch.float64)])
    x = torch.cat([x, -x, torch.tensor([0.0, INF, -INF, NAN], dtype=torch.float64)]).to(dtype).to(device)
    y = torch.empty_like(x)
    _atan_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = torch.atan(x.double())
    fin = (want != 0) & ~want.isnan()
    assert ((y.double()[fin] - want[fin]).abs() / want[fin].abs()).max() < rtol
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[-4:-1].cpu(), torch.tensor([0.0, math.pi / 2, -math.pi / 2], dtype=dtype))
