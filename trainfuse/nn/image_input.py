"""A batch of uint8 images as a model's first convolution reads them, in one pass.

ultralytics' ``preprocess_batch`` makes the ``(N, C, H, W)`` uint8 batch float32 (``float() / 255``:
two kernels, four bytes written for each byte read), a replayed CUDA graph copies that into its
input, autocast casts it to float16 at the first convolution and cuDNN copies it to channels_last,
the layout of the model's weights; a space-to-depth stem (:mod:`trainfuse.nn.stem`) folds and pads
it with three more copies. At batch 16 and 640 px that is about 1.1 GB moved, in six to eight
launches, for a 20 MB batch.

:func:`image_input` writes the convolution's input straight from the uint8 batch in one kernel:
``x / 255`` in the dtype the convolution computes in (autocast's, else its weight's), in its
weight's memory format, and with ``fold=S`` folded ``S x S`` into channels ``(c, dy, dx)`` with zero
channels added (the stem's layout). Its values are looked up in a 256-entry table that torch makes
on the batch's device with stock's own expression (``arange(256).float() / 255``, cast to the
dtype), so they are the bits stock hands the convolution, whatever that device's division does.

:func:`install` puts a forward on a convolution that turns a uint8 input into its input this way
(any other input goes through unchanged): the model then takes the uint8 batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.launch import CachedLauncher, cdiv
from trainfuse.nn.conv_block import InstanceForward

launcher = CachedLauncher()
BLOCK = 2048  # output elements of a program: 16 a thread at 4 warps
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernel's; float64 takes torch's path
_tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@triton.jit
def image_input_kernel(x_ptr, lut_ptr, out_ptr, E, HO, WO, xN, xC, xH, xW, oN, oC, oH, oW,
                       C: tl.constexpr, S: tl.constexpr, CO: tl.constexpr, BLOCK: tl.constexpr,
                       FLAT: tl.constexpr):
    """Program ``i``: output elements ``[i * BLOCK, (i + 1) * BLOCK)`` of the ``E = N * HO * WO *
    CO``, numbered position by position, channels innermost (channels_last's order). Channel ``k =
    (c * S + dy) * S + dx`` of position ``(n, h, w)`` is ``lut[x[n, c, h * S + dy, w * S + dx]]``;
    channels from ``C * S * S`` on are 0 (``lut[0]``). ``FLAT``: the output is dense channels_last,
    element ``e`` at offset ``e`` (contiguous stores); else at its strides."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    p = e // CO
    k = e - p * CO
    HWO = HO * WO
    n = p // HWO
    r = p - n * HWO
    h = r // WO
    w = r - h * WO
    SS: tl.constexpr = S * S
    c = k // SS
    dy = (k // S) % S
    dx = k % S
    src = x_ptr + n.to(tl.int64) * xN + c * xC + (h * S + dy) * xH + (w * S + dx) * xW
    v = tl.load(src, mask=m & (k < C * SS), other=0)
    value = tl.load(lut_ptr + v.to(tl.int32))  # every index is in the table; padding reads lut[0] = 0
    if FLAT:
        tl.store(out_ptr + e, value, mask=m)
    else:
        tl.store(out_ptr + n.to(tl.int64) * oN + k * oC + h * oH + w * oW, value, mask=m)


def table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 256 values ``x / 255`` as stock computes them on ``device`` (``float() / 255``, then the
    cast to ``dtype`` autocast or the model makes), made once per device and dtype. Made outside a
    CUDA graph capture (a capture records its kernels without running them)."""
    key = (device, dtype)
    lut = _tables.get(key)
    if lut is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("image_input: first call for this device and dtype inside a CUDA graph "
                               "capture; call it once before capturing (its value table is made then)")
        lut = _tables[key] = (torch.arange(256, device=device, dtype=torch.uint8).float() / 255).to(dtype)
    return lut


def _fold(y: torch.Tensor, fold: int, channels: int) -> torch.Tensor:
    n, c, h, w = y.shape
    y = y.view(n, c, h // fold, fold, w // fold, fold).permute(0, 1, 3, 5, 2, 4)
    y = y.reshape(n, c * fold * fold, h // fold, w // fold)
    return torch.nn.functional.pad(y, (0, 0, 0, 0, 0, channels - y.shape[1]))


def image_input_torch(x: torch.Tensor, dtype: torch.dtype, fold: int = 1, channels: int | None = None,
                      memory_format: torch.memory_format = torch.channels_last) -> torch.Tensor:
    """:func:`image_input` as stock computes it (``(x.float() / 255).to(dtype)``, then the fold and the
    layout): the reference of the tests and the path of CPUs."""
    y = (x.float() / 255).to(dtype)
    if fold > 1 or (channels or y.shape[1]) != y.shape[1]:
        y = _fold(y, fold, channels or y.shape[1] * fold * fold)
    return y.contiguous(memory_format=memory_format)


def image_input(x: torch.Tensor, dtype: torch.dtype, fold: int = 1, channels: int | None = None,
                memory_format: torch.memory_format = torch.channels_last) -> torch.Tensor:
    """``(x.float() / 255).to(dtype)``, folded ``fold x fold`` into channels and zero-padded to
    ``channels``, in ``memory_format`` (the module docstring), from one kernel on CUDA.

    Args:
        x: ``(N, C, H, W)`` uint8 images, any strides; H and W multiples of ``fold``.
        dtype: the result's dtype, a floating one.
        fold: the space-to-depth factor S (1: none): channel ``(c * S + dy) * S + dx`` of position
            ``(h, w)`` is pixel ``(h * S + dy, w * S + dx)`` of channel ``c``.
        channels: the result's channels, at least ``C * S * S`` (the rest are 0); default ``C * S * S``.
        memory_format: ``torch.channels_last`` or ``torch.contiguous_format``.

    Returns:
        ``(N, channels, H / S, W / S)`` of ``dtype`` in ``memory_format``; ``x`` is only read.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() != 4:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"image_input: x must be (N, C, H, W) uint8 images; got {got}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"image_input: dtype must be a floating dtype; got {dtype!r}")
    if not isinstance(fold, int) or fold < 1 or x.shape[2] % fold or x.shape[3] % fold:
        raise ValueError(f"image_input: fold must be a positive int dividing the height and width "
                         f"{tuple(x.shape[2:])}; got {fold!r}")
    folded = x.shape[1] * fold * fold
    channels = folded if channels is None else channels
    if not isinstance(channels, int) or channels < folded:
        raise ValueError(f"image_input: channels must be an int of at least {folded} (C * fold * fold); "
                         f"got {channels!r}")
    if memory_format not in (torch.channels_last, torch.contiguous_format):
        raise ValueError(f"image_input: memory_format must be torch.channels_last or "
                         f"torch.contiguous_format; got {memory_format!r}")
    N, C, H, W = x.shape
    HO, WO = H // fold, W // fold
    E = N * HO * WO * channels
    if dtype not in DTYPES or x.numel() == 0 or E >= 2**31 or not use_triton(x.device):
        return image_input_torch(x, dtype, fold, channels, memory_format)
    out = torch.empty((N, channels, HO, WO), device=x.device, dtype=dtype, memory_format=memory_format)
    flat = out.is_contiguous(memory_format=torch.channels_last)
    launcher(image_input_kernel, (cdiv(E, BLOCK),), x, table(x.device, dtype), out, E, HO, WO, *x.stride(),
             *out.stride(), C=C, S=fold, CO=channels, BLOCK=BLOCK, FLAT=flat, num_warps=4)
    return out


# ---- a convolution that takes the uint8 batch ------------------------------------------------------
def compute_dtype(weight: torch.Tensor, device: torch.device) -> torch.dtype:
    """The dtype a convolution of ``weight`` computes in on ``device``: autocast's where it is on,
    else the weight's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weight.dtype


def weight_format(conv: nn.Module) -> torch.memory_format:
    """The memory format torch's convolution computes ``conv`` in: channels_last where its weight
    is (whatever the input's), else contiguous."""
    weight = conv.weight
    channels_last = weight.dim() == 4 and weight.is_contiguous(memory_format=torch.channels_last)
    if channels_last and not weight.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def as_conv_input(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``conv`` reads it: uint8 images turned into ``x / 255`` in its compute dtype and
    memory format (:func:`image_input`), anything else unchanged."""
    if x.dtype != torch.uint8:
        return x
    return image_input(x, compute_dtype(conv.weight, x.device), memory_format=weight_format(conv))


class _ImageForward(InstanceForward):
    """The forward :func:`install` puts on a convolution."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.block
        return type(conv).forward(conv, as_conv_input(conv, x))


def takes_images(conv: nn.Module) -> bool:
    """Whether :func:`install` can put its forward on ``conv``: a plain ``nn.Conv2d`` without an
    instance forward of its own."""
    return type(conv) is nn.Conv2d and "forward" not in conv.__dict__


def install(conv: nn.Module) -> bool:
    """``conv`` takes uint8 images from now on (:func:`as_conv_input`; False, nothing done, where
    not :func:`takes_images`)."""
    if not takes_images(conv):
        return False
    conv.forward = _ImageForward(conv)
    return True


def uninstall(conv: nn.Module) -> None:
    """Give ``conv`` its class's forward back."""
    if isinstance(conv.__dict__.get("forward"), _ImageForward):
        del conv.forward


def installed(conv: nn.Module) -> bool:
    """Whether :func:`install` has put its forward on ``conv``."""
    return isinstance(conv.__dict__.get("forward"), _ImageForward)


__all__ = ["as_conv_input", "compute_dtype", "image_input", "image_input_kernel", "image_input_torch",
           "install", "installed", "table", "takes_images", "uninstall", "weight_format"]
