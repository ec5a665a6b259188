"""ultralytics' CSP blocks without their ``torch.cat``: each branch written into its channel slice
of the concatenation by the op that makes it (:class:`trainfuse.nn.concat.ConcatBuffer`), wherever
the blocks are fused (``fuse_blocks``); ``TRAINFUSE_FUSE_CONCAT=0`` keeps the concatenations
(C2f's ``cv1`` halves still written dense).

``C2f`` (and ``C3k2``, which keeps its forward) concatenates ``cv1``'s two halves and each
bottleneck's output; ``C3`` (and ``C3k``) its bottlenecks' output and ``cv2``'s. Where a branch
ends in a fused ``Conv`` block, or in a ``Bottleneck`` whose second ``Conv`` is one (its shortcut
added in the same kernel), its BatchNorm and SiLU write the slice, and a dense copy of the
channels the next branch reads; a branch ending in a nested C2f or C3 block writes through that
block's last ``Conv``; any other branch is copied in. Forward, the concatenation's copy is gone
and the shortcut's add with it; backward, each branch's two grads (the concatenation's slice and
the next branch's) are added inside its BatchNorm's kernels.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from ultralytics.nn.modules.block import C3, Bottleneck, C2f
from ultralytics.nn.modules.conv import Conv

from trainfuse.nn import conv_block
from trainfuse.nn.bn_silu_into import batch_norm_silu_into
from trainfuse.nn.concat import ConcatBuffer

Tensor = torch.Tensor


def enabled() -> bool:
    """Whether the CSP blocks' concatenations are written in place: yes unless
    ``TRAINFUSE_FUSE_CONCAT=0``."""
    return os.environ.get("TRAINFUSE_FUSE_CONCAT", "1") != "0"


def _fused_conv(m: nn.Module) -> bool:
    return type(m) is Conv and conv_block.installed(m)


def _into(m: nn.Module, x: Tensor, buffer: ConcatBuffer, dense_from: int) -> tuple[Tensor, Tensor | None]:
    """``y = m(x)`` written into ``buffer``'s next slice: ``(the slice, y[:, dense_from:] dense or
    None)``."""
    if _fused_conv(m):
        return _bn_into(m, m.conv(x), buffer, dense_from, None)
    if type(m) is Bottleneck and _fused_conv(m.cv2):
        return _bn_into(m.cv2, m.cv2.conv(m.cv1(x)), buffer, dense_from, x if m.add else None)
    if isinstance(m.__dict__.get("forward"), _ConcatFreeForward):
        inner, last = m.forward.inner(x)
        return _into(last, inner, buffer, dense_from)
    y = m(x)
    return buffer.write(y), (y[:, dense_from:] if dense_from < y.shape[1] else None)


def _bn_into(block: nn.Module, z: Tensor, buffer: ConcatBuffer, dense_from: int, residual: Tensor | None):
    op = functools.partial(batch_norm_silu_into, buffer=buffer, dense_from=dense_from, residual=residual)
    return conv_block.batch_norm_silu_module(block.bn, z, op)


def _c2f_inner(block: nn.Module, x: Tensor) -> Tensor:
    """``torch.cat([*cv1(x).chunk(2, 1), m_1(...), ...], 1)`` of ``C2f.forward``, written in place."""
    c, n = block.c, len(block.m)
    buffer = ConcatBuffer((2 + n) * c)
    first, y = _into(block.cv1, x, buffer, c if n else 2 * c)  # the first half in the buffer only
    slices = [first]
    for i, m in enumerate(block.m):
        s, y = _into(m, y, buffer, 0 if i < n - 1 else c)  # the last in the buffer only
        slices.append(s)
    return buffer.join(*slices)


def _c3_inner(block: nn.Module, x: Tensor) -> Tensor:
    """``torch.cat((m(cv1(x)), cv2(x)), 1)`` of ``C3.forward``, written in place."""
    channels = block.cv1.conv.out_channels + block.cv2.conv.out_channels
    buffer = ConcatBuffer(channels)
    *head, last = list(block.m) or [None]
    if last is None:  # no bottleneck: cv1's output is the branch
        s0, _ = _into(block.cv1, x, buffer, block.cv1.conv.out_channels)
    else:
        h = block.cv1(x)
        for m in head:
            h = m(h)
        s0, _ = _into(last, h, buffer, h.shape[1])
    s1, _ = _into(block.cv2, x, buffer, block.cv2.conv.out_channels)
    return buffer.join(s0, s1)


class _ConcatFreeForward(conv_block.InstanceForward):
    """``C2f.forward`` or ``C3.forward`` with the concatenation written in place (module
    docstring)."""

    def inner(self, x: Tensor) -> tuple[Tensor, nn.Module]:
        """The concatenation and the block that reads it (``cv2`` of a C2f, ``cv3`` of a C3)."""
        block = self.block
        if isinstance(block, C2f):
            return _c2f_inner(block, x), block.cv2
        return _c3_inner(block, x), block.cv3

    def __call__(self, x: Tensor) -> Tensor:
        inner, last = self.inner(x)
        return last(inner)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's C2f and C3 blocks that run their class's own forward (C2f's: C2f, C3k2; C3's:
    C3, C3k and the others that keep it), whose first ``Conv`` has the fused forward (give the
    ``Conv`` blocks theirs first); nested ones before the blocks that hold them."""
    found = []
    for m in model.modules():
        if "forward" in m.__dict__:
            continue
        if isinstance(m, C2f) and type(m).forward is C2f.forward and _fused_conv(m.cv1) \
                and m.cv1.conv.out_channels == 2 * m.c:
            found.append(m)
        elif isinstance(m, C3) and type(m).forward is C3.forward and _fused_conv(m.cv1):
            found.append(m)
    return found


def install(block: nn.Module) -> None:
    """Give ``block`` (one of :func:`blocks`) the forward with the concatenation in place."""
    block.forward = _ConcatFreeForward(block)


def uninstall(block: nn.Module) -> None:
    """Give ``block`` its class's forward back."""
    if isinstance(block.__dict__.get("forward"), _ConcatFreeForward):
        del block.forward


__all__ = ["blocks", "enabled", "install", "uninstall"]
