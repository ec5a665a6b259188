"""The model's ``Conv`` blocks with their BatchNorm2d and SiLU as one op
(:mod:`trainfuse.nn.conv_block`), with ``fuse_blocks=True``; the blocks' own forward back at the
end. Off by default until measured on a GPU.

A ``C2f`` block (and ``C3k2`` and the others that keep its forward) splits its ``cv1`` output in two
with ``chunk``: in channels_last the second half is a strided view, which its first bottleneck's
convolution copies before reading (about 2 ms of yolo11m's step on an H200). With the blocks fused,
``cv1`` writes its two halves as two dense tensors instead (:func:`trainfuse.nn.conv_block.halves`),
the same values and statistics.

Each ``SPPF`` block's poolings and concatenation run as one op each way
(:mod:`trainfuse.ultralytics.changes.sppf`), bit for bit the block's numbers.
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override
from ultralytics.nn.modules.block import C2f
from ultralytics.nn.modules.conv import Conv

from trainfuse.clients import ON, Row
from trainfuse.nn import conv_block
from trainfuse.ultralytics.changes import concat_free, sppf
from trainfuse.ultralytics.changes.base import Change, Run


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's ultralytics ``Conv`` blocks whose BatchNorm and SiLU the op computes: ``Conv``
    and the subclasses that keep its forward (``DWConv``, the depthwise blocks of YOLO11's and
    YOLO26's heads)."""
    return [m for m in model.modules()
            if isinstance(m, Conv) and type(m).forward is Conv.forward and conv_block.fusable(m)]


def _c2f_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's C2f blocks that run C2f's own forward, whose ``cv1`` is a fusable ``Conv``."""
    return [m for m in model.modules() if isinstance(m, C2f) and type(m).forward is C2f.forward
            and "forward" not in m.__dict__ and type(m.cv1) is Conv and conv_block.fusable(m.cv1)
            and m.cv1.conv.out_channels % 2 == 0]


class _HalvesForward(conv_block.InstanceForward):
    """``C2f.forward`` with ``cv1``'s halves as two dense tensors (module docstring)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block
        y = list(conv_block.halves(block.cv1, x))
        y.extend(m(y[-1]) for m in block.m)
        return block.cv2(torch.cat(y, 1))


def fuse_model(model: nn.Module, concat: bool = False) -> tuple[list[nn.Module], list[nn.Module]]:
    """Every fusable ``Conv`` block of ``model`` fused, its SPPF blocks' poolings and concatenation
    as one op (:mod:`~trainfuse.ultralytics.changes.sppf`), and its C2f blocks given ``cv1``'s dense
    halves (module docstring), or with ``concat`` its C2f and C3 blocks their concatenations
    written in place (:mod:`~trainfuse.ultralytics.changes.concat_free`); returns the Conv blocks
    and the other blocks changed (C2f / C3, SPPF), for :func:`unfuse_model`."""
    c2f = _c2f_blocks(model)  # before their cv1 takes its fused forward
    blocks = [m for m in _blocks(model) if conv_block.install(m)]
    pools = sppf.blocks(model)
    for block in pools:
        sppf.install(block)
    if concat:
        csp = concat_free.blocks(model)
        for block in csp:
            concat_free.install(block)
        return blocks, csp + pools
    for block in c2f:
        block.forward = _HalvesForward(block)
    return blocks, c2f + pools


def unfuse_model(blocks: list[nn.Module], changed: list[nn.Module]) -> None:
    """Undo :func:`fuse_model`: every block its class's forward back."""
    for block in changed:
        if isinstance(block.__dict__.get("forward"), _HalvesForward):
            del block.forward
        concat_free.uninstall(block)
        sppf.uninstall(block)
    for block in blocks:
        conv_block.uninstall(block)


class FuseBlocks(Change):
    """Each ``Conv`` block's BatchNorm2d and SiLU as one op (module docstring)."""

    kind = "blocks"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._blocks: list[nn.Module] = []
        self._c2f: list[nn.Module] = []
        self._concat = False

    @override
    def name(self, run: Run) -> str:
        return "Conv"

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.on:
            return "fuse_blocks=False"
        if run.trainer.args.compile:
            return "compile is on (it picks its own kernels)"
        if not _blocks(run.model):
            return "the model has no Conv block of Conv2d, BatchNorm2d and SiLU"
        return None

    @override
    def apply(self, run: Run) -> None:
        self._concat = concat_free.enabled()
        self._blocks, self._c2f = fuse_model(run.model, self._concat)

    @override
    def rows(self, run: Run) -> list[Row]:
        if not self._blocks:
            return []
        pools = sum(sppf.installed(m) for m in self._c2f)
        csp = len(self._c2f) - pools
        if self._concat:
            halves = (f"; {csp} C2f and C3 blocks: each branch written into its slice of the "
                      "concatenation by its last BatchNorm (no torch.cat; TRAINFUSE_FUSE_CONCAT=1)")
        else:
            halves = (f"; {csp} C2f blocks: cv1's two halves written as two dense tensors (no copy before "
                      "the first bottleneck)")
        halves = halves if csp else ""
        if pools:
            halves += (f"; {pools} SPPF blocks: the poolings and their concatenation as one op (one launch "
                       "forward, one backward)")
        return [Row(self.kind, self.name(run), ON, f"{len(self._blocks)} Conv blocks: BatchNorm2d and SiLU "
                    "as one op (two launches forward, two backward; the BatchNorm's output is not kept)"
                    + halves)]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        unfuse_model(self._blocks, self._c2f)
        self._blocks, self._c2f = [], []


__all__ = ["FuseBlocks", "fuse_model", "unfuse_model"]
