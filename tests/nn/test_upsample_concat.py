"""trainfuse.nn.upsample_concat: a 2x nearest upsampling concatenated with another map, one launch
each way, against torch's ``cat([interpolate(a), b])`` bit for bit: values, the output's layout,
and the grads (torch adds an upsampled pixel's four grads in float32 and rounds once, on CPU as on
CUDA), in float16, bfloat16 and float32, contiguous and channels_last, either order, odd channel
counts, 1 x 1 maps. Kernels through the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import cuda
from trainfuse.nn.upsample_concat import upsample_concat, upsample_concat_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (N, Ca, Cb, H, W, up_first): channels past a block of 64, one channel, a 1 x 1 map, b first
SHAPES = [(2, 5, 3, 3, 4, True), (1, 70, 6, 2, 3, False), (2, 8, 8, 1, 1, True), (3, 1, 2, 5, 2, False)]


@pytest.fixture(autouse=True)
def _kernels(kernels):
    """The Triton kernels (the interpreter on CPU)."""


def _run(fn, a, b, g, up_first):
    a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out = fn(a, b, up_first)
    out.backward(g)
    return out, a.grad, b.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_layout_and_grads_are_torchs_bits(dtype, channels_last, shape):
    N, CA, CB, H, W, up_first = shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    a = torch.randn(N, CA, H, W, device=DEVICE).to(dtype).contiguous(memory_format=fmt)
    b = torch.randn(N, CB, 2 * H, 2 * W, device=DEVICE).to(dtype).contiguous(memory_format=fmt)
    g = torch.randn(N, CA + CB, 2 * H, 2 * W, device=DEVICE).to(dtype).contiguous(memory_format=fmt)
    out, da, db = _run(upsample_concat, a, b, g, up_first)
    want, want_da, want_db = _run(upsample_concat_torch, a, b, g, up_first)
    assert torch.equal(out, want) and out.stride() == want.stride()
    assert torch.equal(da, want_da) and torch.equal(db, want_db)
    if CA > 1 and H * W > 1:  # (a one-channel or 1 x 1 map's grad may take either layout's strides)
        assert da.stride() == want_da.stride()


@pytest.mark.parametrize("a_dtype,b_dtype,up_dtype,kernel", [
    (torch.float16, torch.float16, torch.float32, True),  # autocast's upsampling, cat promoting
    (torch.bfloat16, torch.float16, torch.float32, True),
    (torch.float32, torch.float16, None, True),  # b widened to a's float32
    (torch.float16, torch.float32, None, False),  # the upsampled map widened: torch's path
])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_an_upsampling_in_float32_and_a_promoting_cat_are_torchs_bits(a_dtype, b_dtype, up_dtype, kernel,
                                                                       channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    a = torch.randn(2, 6, 3, 4, device=DEVICE).to(a_dtype).contiguous(memory_format=fmt)
    b = torch.randn(2, 5, 6, 8, device=DEVICE).to(b_dtype).contiguous(memory_format=fmt)
    g = torch.randn(2, 11, 6, 8, device=DEVICE).contiguous(memory_format=fmt)

    def run(fn):
        a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(a2, b2, False, up_dtype)
        out.backward(g)
        return out, a2.grad, b2.grad

    (out, da, db), want = run(upsample_concat), run(upsample_concat_torch)
    assert (type(out.grad_fn).__name__ == "_UpsampleConcatBackward") == kernel
    assert out.dtype == torch.float32 and torch.equal(out, want[0]) and out.stride() == want[0].stride()
    assert da.dtype == a_dtype and db.dtype == b_dtype
    assert torch.equal(da, want[1]) and torch.equal(db, want[2])


def test_frozen_inputs_mixed_inputs_and_bad_shapes():
    a = torch.randn(2, 4, 3, 3, device=DEVICE)
    b = torch.randn(2, 5, 6, 6, device=DEVICE, requires_grad=True)
    upsample_concat(a, b).sum().backward()  # a without a grad: only b's
    assert torch.equal(b.grad, torch.ones_like(b))
    mixed = upsample_concat(a.half(), b.detach())  # another dtype: torch's path, as torch promotes
    assert torch.equal(mixed, upsample_concat_torch(a.half(), b.detach()))
    strided = torch.randn(2, 4, 3, 6, device=DEVICE)[..., ::2]
    assert torch.equal(upsample_concat(strided, b.detach()), upsample_concat_torch(strided, b.detach()))
    with pytest.raises(ValueError, match=r"upsample_concat: b must be \(2, C, 6, 6\).*got \(2, 5, 6, 5\)"):
        upsample_concat(a, torch.randn(2, 5, 6, 5, device=DEVICE))
    with pytest.raises(ValueError, match=r"upsample_concat: a and b must be \(N, C, H, W\)"):
        upsample_concat(a[0], b)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_yolo11m_neck_sizes_are_torchs_cuda_bits(dtype):
    """yolo11m's two neck joins at batch 16 and 640 px: 512 channels upsampled from 20 x 20 next to
    512 at 40 x 40, and from 40 x 40 next to 256 at 80 x 80 (channels_last)."""
    def make(c: int, side: int) -> torch.Tensor:
        t = torch.randn(16, c, side, side, device="cuda", dtype=dtype)
        return t.contiguous(memory_format=torch.channels_last)

    for ca, cb, side in ((512, 512, 20), (512, 256, 40)):
        a, b, g = make(ca, side), make(cb, 2 * side), make(ca + cb, 2 * side)
        got, want = _run(upsample_concat, a, b, g, True), _run(upsample_concat_torch, a, b, g, True)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
