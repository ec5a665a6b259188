"""The first convolution (3 channels, stride 2) computed on the space-to-depth image, on CUDA:
:mod:`trainfuse.nn.stem` (same function, tensor-core kernels); its own forward back at the end."""

from __future__ import annotations

from torch import nn
from typing_extensions import override

from trainfuse.clients import ON, Row
from trainfuse.nn import stem
from trainfuse.ultralytics.changes.base import Change, Run


def _first_conv(run: Run) -> nn.Module:
    first = run.model.model[0]
    return getattr(first, "conv", first)


class FoldStem(Change):
    """``model.model[0]``'s convolution folded (module docstring)."""

    kind = "stem"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._conv: nn.Module | None = None

    @override
    def name(self, run: Run) -> str:
        return type(run.model.model[0]).__name__

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.on:
            return "fold_stem=False"
        if run.device.type != "cuda":
            return f"the device is {run.device.type}, not CUDA"
        if run.trainer.args.compile:
            return "compile is on (it picks its own kernels)"
        if not stem.foldable(_first_conv(run)):
            return "the first convolution is not a 3-channel stride-2 one the fold covers"
        return None

    @override
    def apply(self, run: Run) -> None:
        conv = _first_conv(run)
        if stem.install(conv):
            self._conv = conv

    @override
    def rows(self, run: Run) -> list[Row]:
        if self._conv is None:
            return []
        conv = self._conv
        return [Row(self.kind, self.name(run), ON, f"first convolution ({conv.in_channels} channels, "
                    f"kernel {conv.kernel_size[0]}, stride 2) computed as a stride-1 convolution on the "
                    "space-to-depth image (same function, tensor-core kernels)")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if self._conv is not None:
            stem.uninstall(self._conv)  # the model computes its stem as before
            self._conv = None


__all__ = ["FoldStem"]
