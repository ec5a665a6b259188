"""A detector's first convolution (3 input channels, stride 2) as a stride-1 convolution on the
space-to-depth input.

YOLOv5's stem is ``Conv2d(3, 16, 6, stride=2, padding=2)`` on the 640 x 640 image; YOLO11's and
YOLO26's, ``Conv2d(3, 16, 3, stride=2, padding=1)``. With 3 input channels in channels_last, cuDNN
has no tensor-core kernel that fits: on an H200 at batch 16 this one layer's forward and weight
grad take about 1.4 ms, a seventh of the model's iteration, for a few GFLOP. The same function is
a stride-1 convolution over the image folded 2 x 2 into channels (YOLOv5's old ``Focus`` layer):

    y[i, j] = sum_{c,u,v} W[c, u, v] x[c, 2i + u - p, 2j + v - p]
            = sum_{(c,dy,dx),a,b} W'[(c,dy,dx), a, b] s[(c,dy,dx), i + a - P, j + b - P]

with ``s[(c,dy,dx), i, j] = x[c, 2i + dy, 2j + dx]``, ``W'[(c,dy,dx), a, b] = W[c, 2a + dy - f,
2b + dx - f]`` (zero outside ``W``; ``f = p mod 2`` shifts the kernel so the padding is even, and
``P = (p + f) / 2``). Its input has 12 channels, padded with zero channels to 16 so that the
tensor-core kernels take it. The weight stays the module's own param (the folded one is made from
it in every forward, a small copy the backward goes through), so the optimizer, checkpoints and
the EMA see the layer as it was.

Exact up to the order of the additions (another cuDNN kernel sums the same products). Used for
even-sized inputs; an odd height or width runs the module's own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from trainfuse.nn import image_input

CHANNEL_MULTIPLE = 8  # what tensor-core convolutions want of the input channels


def _geometry(k: int, p: int) -> tuple[int, int, int]:
    """The folded kernel's size, its padding before and after (even input sizes) of a stride-2
    convolution with kernel ``k`` and padding ``p``."""
    front = p % 2
    size = k + front
    size += size % 2
    half, before = size // 2, (p + front) // 2
    return half, before, (2 * p - k) // 2 + half - before


def foldable(conv: nn.Module) -> bool:
    """Whether :func:`install` computes ``conv`` folded: a plain ``Conv2d`` on 3 channels, stride 2,
    dilation 1, one group, zero padding, whose fold is a convolution of kernel 3 or more with even
    padding (YOLOv5's 6 x 6 stem: 3 x 3 on 16 channels, twice as fast on an H200). A 3 x 3 stem
    (YOLO11, YOLO26) folds to 2 x 2 with uneven padding, which measured slower than the original."""
    if not (type(conv) is nn.Conv2d and conv.in_channels == 3 and conv.stride == (2, 2)
            and conv.dilation == (1, 1) and conv.groups == 1 and conv.padding_mode == "zeros"
            and isinstance(conv.padding, tuple) and conv.padding[0] == conv.padding[1]
            and conv.kernel_size[0] == conv.kernel_size[1]):
        return False
    half, before, after = _geometry(conv.kernel_size[0], conv.padding[0])
    return half >= 3 and before == after


def _folded_weight(weight: torch.Tensor, padding: int, channels: int) -> tuple[torch.Tensor, int]:
    """``W'`` of the module docstring, its input channels zero-padded to ``channels``; and ``P``."""
    out, cin, k, _ = weight.shape
    half, before, _ = _geometry(k, padding)
    front, size = padding % 2, 2 * half
    w = F.pad(weight, (front, size - k - front, front, size - k - front))  # (out, cin, size, size)
    w = w.view(out, cin, half, 2, half, 2).permute(0, 1, 3, 5, 2, 4).reshape(out, cin * 4, half, half)
    return F.pad(w, (0, 0, 0, 0, 0, channels - cin * 4)), before


def space_to_depth(x: torch.Tensor, channels: int) -> torch.Tensor:
    """``x`` (N, C, H, W), H and W even, folded 2 x 2 into channels ``(c, dy, dx)``: (N, 4C, H/2,
    W/2), zero channels added up to ``channels``, channels_last."""
    n, c, h, w = x.shape
    s = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, c * 4, h // 2, w // 2)
    s = F.pad(s, (0, 0, 0, 0, 0, channels - c * 4))
    return s.contiguous(memory_format=torch.channels_last)


def folded_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  padding: int) -> torch.Tensor:
    """``conv2d(x, weight, bias, stride=2, padding=padding)`` for even H and W, computed on the
    space-to-depth input (module docstring). uint8 images are taken as ``x / 255`` in the dtype the
    convolution computes in, folded as they are converted (:func:`~trainfuse.nn.image_input.
    image_input`)."""
    channels = -(-x.shape[1] * 4 // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE
    w, pad = _folded_weight(weight, padding, channels)
    h_out = (x.shape[2] + 2 * padding - weight.shape[2]) // 2 + 1
    w_out = (x.shape[3] + 2 * padding - weight.shape[3]) // 2 + 1
    if x.dtype == torch.uint8:
        s = image_input.image_input(x, image_input.compute_dtype(weight, x.device), fold=2, channels=channels)
    else:
        s = space_to_depth(x, channels)
    half = w.shape[2]
    bottom = h_out - s.shape[2] - pad + half - 1  # what the output size needs below and right
    right = w_out - s.shape[3] - pad + half - 1
    if bottom == pad and right == pad:
        return F.conv2d(s, w.to(memory_format=torch.channels_last), bias, padding=pad)
    s = F.pad(s, (pad, right, pad, bottom))
    return F.conv2d(s, w.to(memory_format=torch.channels_last), bias)


class _FoldedForward:
    """The forward :func:`install` puts on a conv; a deep copy of the module gets the plain one."""

    def __init__(self, conv: nn.Conv2d) -> None:
        self.conv = conv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if x.dim() != 4 or x.shape[2] % 2 or x.shape[3] % 2:
            return nn.Conv2d.forward(conv, image_input.as_conv_input(conv, x) if x.dim() == 4 else x)
        return folded_conv2d(x, conv.weight, conv.bias, conv.padding[0])

    def __deepcopy__(self, memo: dict) -> types.MethodType:
        twin = memo.get(id(self.conv))
        if twin is None:
            raise TypeError("space-to-depth stem: copy the module, not its forward")
        return types.MethodType(nn.Conv2d.forward, twin)


def install(conv: nn.Module) -> bool:
    """Compute ``conv`` folded from now on (an instance attribute; False, nothing done, where it is
    not :func:`foldable` or has a forward of its own set)."""
    if not foldable(conv) or "forward" in conv.__dict__:
        return False
    conv.forward = _FoldedForward(conv)
    return True


def uninstall(conv: nn.Module) -> None:
    """Give ``conv`` its own forward back."""
    if isinstance(conv.__dict__.get("forward"), _FoldedForward):
        del conv.forward


def installed(conv: nn.Module) -> bool:
    """Whether :func:`install` has put its forward on ``conv`` (which takes uint8 images too)."""
    return isinstance(conv.__dict__.get("forward"), _FoldedForward)


__all__ = ["folded_conv2d", "foldable", "install", "installed", "space_to_depth", "uninstall"]
