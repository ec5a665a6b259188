"""ultralytics' ``SPPF`` with its poolings and their concatenation as one op each way
(:func:`trainfuse.nn.pool_chain.max_pool_chain`), with ``fuse_blocks=True``: the same values and
grads, bit for bit.

``SPPF.forward`` is ``cv2(cat([y, m(y), m(m(y)), ...]))`` with ``y = cv1(x)`` and ``n`` poolings
(3 by default) of ``m = nn.MaxPool2d(k, 1, k // 2)``, plus ``x`` where ``shortcut`` made ``add``
(YOLO26). A block whose class keeps that forward and whose ``m`` pools as that (stride 1, the
padding ``k // 2``, no dilation, floor mode) takes an instance forward that runs the chain as
one op; a deep copy (the EMA, a checkpoint) gets the class's forward.
"""

from __future__ import annotations

import torch
from torch import nn
from ultralytics.nn.modules.block import SPPF

from trainfuse.nn import conv_block
from trainfuse.nn.pool_chain import max_pool_chain


def _pooling(m: nn.Module) -> int | None:
    """The window side of ``m`` where it is ``nn.MaxPool2d(k, 1, k // 2)`` with an odd ``k`` (the
    pooling that keeps the map's size), else None."""
    if type(m) is not nn.MaxPool2d or m.ceil_mode or m.return_indices:
        return None

    def one(v):
        return v if isinstance(v, int) else (v[0] if len(set(v)) == 1 else None)

    k, stride, pad, dilation = one(m.kernel_size), one(m.stride), one(m.padding), one(m.dilation)
    if k is None or k % 2 == 0 or k > 15 or stride != 1 or pad != k // 2 or dilation != 1:
        return None
    return k


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's SPPF blocks that run ``SPPF.forward`` with a size-keeping max pooling."""
    return [m for m in model.modules() if isinstance(m, SPPF) and type(m).forward is SPPF.forward
            and "forward" not in m.__dict__ and _pooling(m.m) is not None and getattr(m, "n", 3) >= 1]


class _ChainForward(conv_block.InstanceForward):
    """``SPPF.forward`` with the poolings and the concatenation as one op (module docstring)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block
        y = block.cv2(max_pool_chain(block.cv1(x), _pooling(block.m), getattr(block, "n", 3)))
        return y + x if getattr(block, "add", False) else y


def install(block: nn.Module) -> None:
    """Give ``block`` (one of :func:`blocks`) the fused forward."""
    block.forward = _ChainForward(block)


def uninstall(block: nn.Module) -> None:
    """Give ``block`` its class's forward back."""
    if isinstance(block.__dict__.get("forward"), _ChainForward):
        del block.forward


def installed(block: nn.Module) -> bool:
    return isinstance(block.__dict__.get("forward"), _ChainForward)


__all__ = ["blocks", "install", "installed", "uninstall"]
