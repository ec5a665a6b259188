"""The model's ``Conv`` blocks with their BatchNorm2d and SiLU as one op
(:mod:`trainfuse.nn.conv_block`), with ``fuse_blocks=True``; the blocks' own forward back at the
end. Off by default until measured on a GPU."""

from __future__ import annotations

from torch import nn
from typing_extensions import override
from ultralytics.nn.modules.conv import Conv

from trainfuse.clients import ON, Row
from trainfuse.nn import conv_block
from trainfuse.ultralytics.changes.base import Change, Run


def _blocks(run: Run) -> list[nn.Module]:
    """The model's ultralytics ``Conv`` blocks whose BatchNorm and SiLU the op computes."""
    return [m for m in run.model.modules() if type(m) is Conv and conv_block.fusable(m)]


class FuseBlocks(Change):
    """Each ``Conv`` block's BatchNorm2d and SiLU as one op (module docstring)."""

    kind = "blocks"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._blocks: list[nn.Module] = []

    @override
    def name(self, run: Run) -> str:
        return "Conv"

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.on:
            return "fuse_blocks=False"
        if run.trainer.args.compile:
            return "compile is on (it picks its own kernels)"
        if not _blocks(run):
            return "the model has no Conv block of Conv2d, BatchNorm2d and SiLU"
        return None

    @override
    def apply(self, run: Run) -> None:
        self._blocks = [m for m in _blocks(run) if conv_block.install(m)]

    @override
    def rows(self, run: Run) -> list[Row]:
        if not self._blocks:
            return []
        return [Row(self.kind, self.name(run), ON, f"{len(self._blocks)} Conv blocks: BatchNorm2d and SiLU "
                    "as one op (three launches forward, three backward; the BatchNorm's output is not kept)")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        for block in self._blocks:
            conv_block.uninstall(block)
        self._blocks = []


__all__ = ["FuseBlocks"]
