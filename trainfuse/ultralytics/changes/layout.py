"""The model's 4-d weights in channels_last, with ``channels_last=True``: its convolutions then take
and make NHWC activations, cuDNN's tensor-core layout, where ultralytics trains NCHW (each
convolution then transposes on the way in or out). Made first, before the optimizer swap builds its
tables and masters from the weights; the model is contiguous again at the end. Off by default until
measured on a GPU."""

from __future__ import annotations

import torch
from typing_extensions import override

from trainfuse.clients import ON, Row
from trainfuse.ultralytics.changes.base import Change, Run


class ChannelsLast(Change):
    """The model in channels_last for the run (module docstring)."""

    kind = "layout"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._done = False

    @override
    def name(self, run: Run) -> str:
        return "channels_last"

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.on:
            return "channels_last=False"
        if run.trainer.args.compile:
            return "compile is on (it picks its own layouts)"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        if run.model is not run.trainer.model:
            return "DDP laid its gradient buckets out over the contiguous weights when it wrapped the model"
        return None

    @override
    def apply(self, run: Run) -> None:
        run.model.to(memory_format=torch.channels_last)
        self._done = True

    @override
    def rows(self, run: Run) -> list[Row]:
        convs = sum(p.dim() == 4 for p in run.model.parameters())
        return [Row(self.kind, self.name(run), ON, f"{convs} 4-d weights in channels_last: the convolutions "
                    "take and make NHWC activations")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if self._done:
            run.model.to(memory_format=torch.contiguous_format)
            self._done = False


__all__ = ["ChannelsLast"]
