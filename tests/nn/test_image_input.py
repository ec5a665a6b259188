"""trainfuse.nn.image_input: uint8 images as a first convolution reads them, against stock's
``(x.float() / 255).to(dtype)`` (then the stem's fold and the layout) bit for bit, in float16,
bfloat16 and float32, both layouts, folded and not, odd and empty shapes, strided inputs; the
convolution forwards that take uint8 images (plain and folded stem) against the convolution of
stock's float input. Kernels through the interpreter on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._helpers import cuda
from trainfuse.nn import image_input, stem
from trainfuse.nn.image_input import image_input as to_input
from trainfuse.nn.image_input import image_input_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FORMATS = {"nhwc": torch.channels_last, "nchw": torch.contiguous_format}
# (N, C, H, W, fold, channels): the YOLOv5 stem's fold (12 channels padded to 16), RGB unfolded, odd
# sizes, one channel, more channels than a tile's power of two, an empty batch, a 1 x 1 image
SHAPES = [(2, 3, 8, 6, 2, 16), (2, 3, 5, 7, 1, None), (3, 1, 4, 4, 2, None), (1, 5, 6, 2, 2, 24),
          (0, 3, 4, 4, 2, 16), (1, 3, 1, 1, 1, 4), (2, 3, 9, 3, 3, 32)]


@pytest.fixture(autouse=True)
def _kernels(kernels):
    """The Triton kernels (the interpreter on CPU)."""


def _images(n, c, h, w, channels_last=False):
    x = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, device=DEVICE)
    x.view(-1)[:4] = torch.tensor([0, 255, 1, 254], dtype=torch.uint8)[: x.numel()]  # the ends of the table
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS, ids=list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[:4]}-fold{s[4]}" for s in SHAPES])
def test_equals_stocks_division_and_layout_bit_for_bit(shape, fmt, dtype):
    n, c, h, w, fold, channels = shape
    x = _images(n, c, h, w)
    kept = x.clone()
    out = to_input(x, dtype, fold, channels, FORMATS[fmt])
    ref = image_input_torch(x, dtype, fold, channels, FORMATS[fmt])
    assert out.shape == ref.shape == (n, channels or c * fold * fold, h // fold, w // fold)
    assert out.dtype == dtype and out.is_contiguous(memory_format=FORMATS[fmt])
    assert torch.equal(out, ref)
    assert torch.equal(x, kept)  # only read


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_are_x_over_255_rounded_once(dtype):
    """Every uint8 value against float64's x / 255: within a unit in the last place of the dtype
    (float32's quotient rounded to the dtype: two roundings); 0 and 255 exact."""
    x = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(1, 1, 16, 16)
    out = to_input(x, dtype).double().flatten()
    exact = torch.arange(256, dtype=torch.float64, device=DEVICE) / 255
    eps = torch.finfo(dtype).eps
    assert (out - exact).abs().le(exact * eps).all()  # an ulp of v is at most eps * v
    assert out[0] == 0 and out[255] == 1


def test_strided_images_are_read_where_they_are():
    """A channels_last batch and a cropped view of one: the same values as their dense copies."""
    base = _images(2, 3, 10, 12, channels_last=True)
    for x in (base, base[:, :, 1:9, 2:10], base[:, [2, 1, 0]]):
        for fold in (1, 2):
            out = to_input(x, torch.float16, fold)
            assert torch.equal(out, image_input_torch(x.contiguous(), torch.float16, fold))


@pytest.mark.parametrize("bad,message", [
    (dict(x=torch.zeros(1, 3, 4, 4)), "uint8 images"),
    (dict(x=torch.zeros(3, 4, 4, dtype=torch.uint8)), "uint8 images"),
    (dict(dtype=torch.int32), "floating dtype"),
    (dict(fold=3), "dividing the height and width"),
    (dict(fold=0), "dividing the height and width"),
    (dict(fold=2, channels=8), "at least 12"),
    (dict(memory_format=torch.channels_last_3d), "memory_format"),
], ids=["float", "3d", "int-dtype", "fold-3", "fold-0", "channels", "format"])
def test_bad_arguments_are_refused_naming_them(bad, message):
    args = dict(x=torch.zeros(1, 3, 4, 4, dtype=torch.uint8, device=DEVICE), dtype=torch.float16, fold=1,
                channels=None, memory_format=torch.channels_last)
    args.update(bad)
    kept = args["x"].clone()
    with pytest.raises(ValueError, match=message):
        to_input(args["x"], args["dtype"], args["fold"], args["channels"], args["memory_format"])
    assert torch.equal(args["x"], kept)


# ---- convolutions that take the uint8 batch -----------------------------------------------------
def _stock_input(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255  # ultralytics' preprocess_batch


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_installed_conv_computes_on_stocks_input(channels_last):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, 2, 1, bias=False).to(DEVICE)
    if channels_last:
        conv = conv.to(memory_format=torch.channels_last)
    x = _images(2, 3, 10, 14)
    ref = conv(_stock_input(x))
    assert image_input.install(conv) and image_input.installed(conv)
    assert not image_input.install(conv)  # once
    out = conv(x)
    assert torch.equal(out, ref)
    fx = _stock_input(x)
    assert torch.equal(conv(fx), ref)  # a float input goes through unchanged
    twin = copy.deepcopy(nn.Sequential(conv))[0]
    assert not image_input.installed(twin)
    assert torch.equal(twin(fx), ref)
    image_input.uninstall(conv)
    assert "forward" not in conv.__dict__


def test_installed_conv_takes_autocasts_dtype():
    """Under autocast the input is made in autocast's dtype, which is what autocast casts stock's
    float32 input to: the same output."""
    torch.manual_seed(0)
    dtype = torch.float16 if DEVICE.type == "cuda" else torch.bfloat16
    conv = nn.Conv2d(3, 8, 3, 2, 1).to(DEVICE).to(memory_format=torch.channels_last)
    x = _images(2, 3, 8, 8)
    with torch.autocast(DEVICE.type, dtype=dtype):
        ref = conv(_stock_input(x))
        image_input.install(conv)
        seen = []
        handle = conv.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
        out = conv(x)
        handle.remove()
    assert seen == [torch.uint8] and out.dtype == ref.dtype == dtype
    assert torch.equal(out, ref)


def test_takes_images_only_plain_convolutions_without_a_forward():
    class Own(nn.Conv2d):
        pass

    assert not image_input.takes_images(Own(3, 4, 3))
    conv = nn.Conv2d(3, 4, 3)
    conv.forward = lambda t: t
    assert not image_input.takes_images(conv) and not image_input.install(conv)


@pytest.mark.parametrize("hw", [(8, 8), (10, 6), (7, 8)], ids=["even", "uneven", "odd"])
def test_folded_stem_takes_uint8_images(hw):
    """The folded stem (YOLOv5's 6 x 6) converts and folds in one kernel: the folded convolution of
    stock's input; an odd size takes the convolution's own forward on stock's input."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 6, 2, 2, bias=False).to(DEVICE).to(memory_format=torch.channels_last)
    x = _images(2, 3, *hw)
    assert stem.install(conv) and stem.installed(conv)
    ref = conv(_stock_input(x))
    out = conv(x)
    assert torch.equal(out, ref)
    torch.testing.assert_close(out, F.conv2d(_stock_input(x), conv.weight, None, 2, 2), rtol=1e-5, atol=1e-5)
    stem.uninstall(conv)
    assert not stem.installed(conv)


@cuda
def test_the_table_is_made_before_a_capture():
    """A first call inside a CUDA graph capture says to call it once before (its table would be
    recorded, not made); once made, calls capture and replay."""
    dtype = torch.float64  # a dtype no other test makes a table of
    image_input._tables.pop((DEVICE, dtype), None)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph):
            image_input.table(DEVICE, dtype)
    x16 = _images(2, 3, 8, 8)
    to_input(x16, torch.float16, 2, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = to_input(x16, torch.float16, 2, 16)
    x16.copy_(_images(2, 3, 8, 8))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, image_input_torch(x16, torch.float16, 2, 16))
