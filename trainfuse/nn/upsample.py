"""Nearest upsampling in its input's dtype under autocast.

CUDA autocast runs ``upsample_nearest*`` in float32 (it is on autocast's float32 list): a float16
feature map is cast up, upsampled in float32, and what reads it next reads float32. In a YOLO neck
that is a ``Concat``, which then copies both of its inputs to float32 (the other one cast up as it
is copied), and the convolution after it casts the whole concatenation back to float16; the
backward makes each of those copies again the other way. On yolo11m at batch 16 and 640 px the two
upsamplings and what they cause take about 2 ms of a 24 ms step on an H200.

Nearest upsampling copies values, so in float16 it gives the very numbers float32 gives. Where
the output reaches only a concatenation that convolutions read (what :func:`install`'s callers
check), the convolutions see the same float16 inputs, and the backward the same grads: the
upsampling's backward adds each input pixel's grads in float32 in both dtypes (its accumulation
type) and rounds once, to float16 here where stock rounds the float32 result at the cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainfuse.nn.conv_block import InstanceForward


def nearest(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Upsample`` in ``nearest`` mode without an instance forward
    set already."""
    return type(module) is nn.Upsample and module.mode == "nearest" and "forward" not in module.__dict__


class _InputDtypeForward(InstanceForward):
    """``nn.Upsample.forward`` with autocast off: the output in the input's dtype."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.block
        with torch.autocast(x.device.type, enabled=False):
            return F.interpolate(x, m.size, m.scale_factor, m.mode, m.align_corners,
                                 recompute_scale_factor=m.recompute_scale_factor)


def install(module: nn.Module) -> bool:
    """Run ``module``'s nearest upsampling in its input's dtype from now on (False, nothing done,
    where it is not :func:`nearest`). The caller checks that what reads the output does not mind
    float16 where it had float32 (module docstring)."""
    if not nearest(module):
        return False
    module.forward = _InputDtypeForward(module)
    return True


def uninstall(module: nn.Module) -> None:
    """Give ``module`` its class's forward back."""
    if isinstance(module.__dict__.get("forward"), _InputDtypeForward):
        del module.forward


def installed(module: nn.Module) -> bool:
    """Whether :func:`install` has put its forward on ``module``."""
    return isinstance(module.__dict__.get("forward"), _InputDtypeForward)


__all__ = ["install", "installed", "nearest", "uninstall"]
