"""trainfuse.losses.mask_bce.cropped_mask_bce (the segmentation loss's mask term) against a float64
torch reference: both kinds of masks, odd sizes (fewer coefficients than a tl.dot tile, slots and
pixels past a block's end), empty inputs, boxes past the mask's edges and empty boxes, upstream
grads other than 1; the same bits on every call; the inputs left as they were; bad inputs refused.
Kernels run through the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from trainfuse.losses.mask_bce import cropped_mask_bce, mask_bce_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
U = torch.finfo(torch.float32).eps / 2  # a float32 rounding
# (B, nm, C, h, w, M): nm 5 and 1 below a tl.dot tile of 16, 32 as ultralytics' heads; C 19 past a
# block of 16 slots; 7 x 13 = 91 and 16 x 16 = 256 pixels, one block of 128 and two
SHAPES = [(2, 5, 19, 7, 13, 3), (1, 32, 16, 16, 16, 4), (3, 1, 1, 1, 1, 1)]


def inputs(B, nm, C, H, W, M, overlap):
    coef = torch.randn(B, nm, C, device=DEVICE) * 2
    proto = torch.randn(B, nm, H, W, device=DEVICE)
    if overlap:  # index maps: 0 for no label, 1..M an image's labels; slots ask for 1..M and M + 1 (none)
        masks = torch.randint(0, M + 1, (B, H, W), dtype=torch.uint8, device=DEVICE)
        index = torch.randint(1, M + 2, (B, C), device=DEVICE)
    else:
        masks = (torch.rand(B, M, H, W, device=DEVICE) > 0.5).float()
        index = torch.randint(0, M, (B, C), device=DEVICE)
    corner = torch.rand(B, C, 2, device=DEVICE) * torch.tensor([W + 2.0, H + 2.0], device=DEVICE) - 1
    size = torch.rand(B, C, 2, device=DEVICE) * torch.tensor([W, H], device=DEVICE)
    size[..., 0][torch.rand(B, C, device=DEVICE) < 0.1] = 0  # some empty boxes
    return coef, proto, masks, index, torch.cat((corner, corner + size), -1)


def reference(coef, proto, masks, index, boxes, overlap, go):
    """float64: the sums, the grads for ``go``, and the sums of the absolute values of what each
    adds (the scale of a float32 result's rounding)."""
    c64, p64 = coef.double().requires_grad_(), proto.double().requires_grad_()
    out = mask_bce_torch(c64, p64, masks, index, boxes.double(), overlap=overlap)
    gc, gp = torch.autograd.grad(out, (c64, p64), go.double()) if out.numel() else (c64 * 0, p64 * 0)
    with torch.no_grad():
        H, W = proto.shape[-2:]
        terms = torch.einsum("bnc,bnhw->bchw", c64.abs(), p64.abs()) + 1  # |logit| bound, + 1 for the log
        crop = _crop(boxes.double(), H, W)  # (B, C, H, W) 0/1
        s_out = (terms * crop).sum((2, 3))
        s_coef = torch.einsum("bchw,bnhw->bnc", terms * crop * go.double().abs()[..., None, None], p64.abs())
        s_proto = torch.einsum("bchw,bnc->bnhw", terms * crop * go.double().abs()[..., None, None], c64.abs())
    return out, gc, gp, s_out, s_coef, s_proto


def _crop(boxes, H, W):
    x1, y1, x2, y2 = boxes.unbind(-1)
    cols = torch.arange(W, device=boxes.device, dtype=boxes.dtype)
    lines = torch.arange(H, device=boxes.device, dtype=boxes.dtype)
    inx = (cols >= x1[..., None]) & (cols < x2[..., None])
    iny = (lines >= y1[..., None]) & (lines < y2[..., None])
    return (iny[..., :, None] & inx[..., None, :]).double()


def within(got, want, scale, n):
    """``got`` (float32) within ``n + 16`` float32 roundings of each summand's magnitude of ``want``."""
    bound = (n + 16) * U * scale + 1e-30
    err = (got.double() - want).abs()
    worst = err.argmax()
    assert (err <= bound).all(), f"error {err.max().item():.3g} beyond {bound.flatten()[worst].item():.3g}"


@pytest.mark.parametrize("overlap", [True, False], ids=["index-maps", "a-mask-per-label"])
@pytest.mark.parametrize("shape", SHAPES, ids=["odd", "heads", "single"])
def test_sums_and_grads_match_float64(kernels, shape, overlap):
    coef, proto, masks, index, boxes = inputs(*shape, overlap)
    before = [t.clone() for t in (coef, proto, masks, index, boxes)]
    go = torch.rand(shape[0], shape[2], device=DEVICE) * 2 - 0.5
    c, p = coef.clone().requires_grad_(), proto.clone().requires_grad_()
    out = cropped_mask_bce(c, p, masks, index, boxes, overlap=overlap)
    gc, gp = torch.autograd.grad(out, (c, p), go)
    want, wc, wp, s_out, s_coef, s_proto = reference(coef, proto, masks, index, boxes, overlap, go)
    B, nm, C, H, W, _ = shape
    assert out.dtype == torch.float32 and out.shape == (B, C)
    within(out, want, s_out, H * W + nm)
    within(gc, wc, s_coef, H * W + nm)
    within(gp, wp, s_proto, C + nm)
    for t, b in zip((coef, proto, masks, index, boxes), before):
        assert torch.equal(t, b)  # nothing written into the inputs


@pytest.mark.parametrize("overlap", [True, False], ids=["index-maps", "a-mask-per-label"])
def test_every_call_gives_the_same_bits(kernels, overlap):
    coef, proto, masks, index, boxes = inputs(2, 32, 24, 9, 20, 3, overlap)
    go = torch.rand(2, 24, device=DEVICE)
    runs = []
    for _ in range(2):
        c, p = coef.clone().requires_grad_(), proto.clone().requires_grad_()
        out = cropped_mask_bce(c, p, masks, index, boxes, overlap=overlap)
        runs.append((out, *torch.autograd.grad(out, (c, p), go)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(0, 4, 3, 5, 5, 2), (2, 4, 0, 5, 5, 2), (2, 4, 3, 0, 5, 2)],
                         ids=["no-images", "no-slots", "no-pixels"])
def test_empty_inputs_give_zero_sums_and_grads(kernels, shape):
    B, nm, C, H, W, M = shape
    coef = torch.randn(B, nm, C, device=DEVICE, requires_grad=True)
    proto = torch.randn(B, nm, H, W, device=DEVICE, requires_grad=True)
    masks = torch.zeros(B, H, W, dtype=torch.uint8, device=DEVICE)
    index = torch.ones(B, C, dtype=torch.long, device=DEVICE)
    boxes = torch.zeros(B, C, 4, device=DEVICE)
    out = cropped_mask_bce(coef, proto, masks, index, boxes, overlap=True)
    assert out.shape == (B, C) and not out.any()
    out.sum().backward()
    assert coef.grad is not None and not coef.grad.any() and proto.grad is not None and not proto.grad.any()


def test_float64_takes_the_torch_reference(kernels):
    coef, proto, masks, index, boxes = inputs(2, 5, 7, 6, 6, 2, True)
    got = cropped_mask_bce(coef.double(), proto.double(), masks, index, boxes, overlap=True)
    want = mask_bce_torch(coef.double(), proto.double(), masks, index, boxes, overlap=True)
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_bad_inputs_are_refused_naming_the_argument():
    coef, proto, masks, index, boxes = inputs(2, 5, 7, 6, 6, 2, True)
    with pytest.raises(ValueError, match=r"coef must be \(B, nm, C\) and proto \(B, nm, h, w\)"):
        cropped_mask_bce(coef, proto[:, :4], masks, index, boxes, overlap=True)
    with pytest.raises(ValueError, match=r"masks must be \(B, h, w\) index maps \(overlap=True\)"):
        cropped_mask_bce(coef, proto, masks[:, :5], index, boxes, overlap=True)
    with pytest.raises(ValueError, match=r"masks must be \(B, M, h, w\) masks \(overlap=False\)"):
        cropped_mask_bce(coef, proto, masks, index, boxes, overlap=False)
    with pytest.raises(ValueError, match=r"index must be an integer \(B, C\)"):
        cropped_mask_bce(coef, proto, masks, index.float(), boxes, overlap=True)
    with pytest.raises(ValueError, match=r"boxes must be \(B, C, 4\)"):
        cropped_mask_bce(coef, proto, masks, index, boxes[..., :3], overlap=True)
    with pytest.raises(ValueError, match="coef and proto must be floating point of one dtype"):
        cropped_mask_bce(coef, proto.double(), masks, index, boxes, overlap=True)
