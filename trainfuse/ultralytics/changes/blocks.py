"""The model's ``Conv`` blocks with their BatchNorm2d and SiLU as one op
(:mod:`trainfuse.nn.conv_block`), with ``fuse_blocks``; the blocks' own forward back at the end.
By default (``fuse_blocks=None``) on for detection models of :data:`DEFAULT_MIN_PARAMS` parameters
or more trained on one CUDA device, where it was measured (an H200: YOLO11s's and YOLO11m's
iterations 18 and 22 % shorter than without them, mAP within a point of stock after 30 epochs).
A nano model's replayed step is not bound by these kernels (yolov5n's iteration measured the same
with them), while their first compile on a cold Triton cache costs seconds of the first epoch.
``True`` turns them on for any model, the other tasks', under DDP and on the CPU (the torch
reference there).

A ``C2f`` block (and ``C3k2`` and the others that keep its forward) splits its ``cv1`` output in two
with ``chunk``: in channels_last the second half is a strided view, which its first bottleneck's
convolution copies before reading (about 2 ms of yolo11m's step on an H200). With the blocks fused,
``cv1`` writes its two halves as two dense tensors instead (:func:`trainfuse.nn.conv_block.halves`),
the same values and statistics.

Each ``SPPF`` block's poolings and concatenation run as one op each way
(:mod:`trainfuse.ultralytics.changes.sppf`), bit for bit the block's numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from typing_extensions import override
from ultralytics.nn.modules.block import C2f
from ultralytics.nn.modules.conv import Conv
from ultralytics.nn.tasks import guess_model_scale

from trainfuse.clients import ON, Row
from trainfuse.nn import conv_block
from trainfuse.ultralytics.changes import concat_free, sppf
from trainfuse.ultralytics.changes.base import Change, Run

DEFAULT_MIN_PARAMS = 5_000_000  # YOLO11s has 9.4M, the nano models 2.4M to 2.7M


def why_off(setting: bool | None, run: Run) -> str | None:
    """Why the trainer's ``fuse_blocks`` setting leaves the fused blocks (and the neck's joined
    upsamplings) off for ``run``, or None."""
    if setting is False:
        return "fuse_blocks=False"
    if setting is None:
        if run.device.type != "cuda":
            return "fuse_blocks defaults to on for CUDA devices only (True runs the torch reference here)"
        if run.trainer.args.task != "detect":
            return (f"fuse_blocks defaults to on for detection models only (True turns it on for this "
                    f"{run.trainer.args.task} model)")
        if run.trainer.world_size > 1:
            return "fuse_blocks defaults to off under DDP (True turns it on)"
        params = sum(p.numel() for p in run.model.parameters())
        if params < DEFAULT_MIN_PARAMS:
            return (f"fuse_blocks defaults to on for models of {DEFAULT_MIN_PARAMS / 1e6:.0f}M parameters or "
                    f"more (this one has {params / 1e6:.1f}M: its step is not bound by these kernels; True "
                    "turns it on)")
    return None


def likely_fused(setting: bool | None, task: str, model: object, world_size: int) -> bool:
    """Whether a run will fuse its blocks, guessed before its model is built (to compile their
    kernels ahead): ``fuse_blocks=True``, or the default for a detection model whose name says a
    scale above nano (``yolo11s.yaml``, ``yolov8m.pt``) on one GPU. A wrong guess costs the compile
    workers some CPU time, or leaves the kernels to compile in the run."""
    if setting is not None:
        return setting
    scale = guess_model_scale(model) if isinstance(model, (str, Path)) else ""
    return task == "detect" and world_size <= 1 and scale in ("s", "m", "l", "x")


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

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self._blocks: list[nn.Module] = []
        self._c2f: list[nn.Module] = []
        self._concat = False

    @override
    def name(self, run: Run) -> str:
        return "Conv"

    @override
    def why_off(self, run: Run) -> str | None:
        off = why_off(self.setting, run)
        if off is not None:
            return off
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
                      "concatenation by its last BatchNorm (no torch.cat)")
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
