"""cuDNN's convolution algorithms chosen by timing them for the training step's shapes
(``torch.backends.cudnn.benchmark``) during the training epochs, with ``cudnn_benchmark=True``
(off by default until measured on a GPU); the user's setting back for validation and at the end.

From yolo11s upward the fused step's GPU time is mostly the model's convolutions, which cuDNN runs
with the algorithms its heuristics pick when ``benchmark`` is off, as ultralytics leaves it (its
line that turned it on is commented out: AutoBatch measures memory with the heuristics'
algorithms). The training step's shapes are fixed (one image size, one batch size, and the last
batch's), so timing each convolution's candidates costs a few of the first iterations once; a
graphed step keeps the algorithms it was captured with. Validation's rectangular batches change
shape from batch to batch, so it runs with the user's setting. With ``deterministic=True``
(ultralytics' default: ``torch.backends.cudnn.deterministic``) cuDNN times its deterministic
algorithms only; which of them is fastest can differ from one run to the next, so two runs may
differ by roundings where the heuristics' choice would have made them bit-identical, which is why
the option is named and off by default.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from trainfuse.clients import ON, Row
from trainfuse.ultralytics.changes.base import Change, Run


class ConvAlgorithms(Change):
    """``torch.backends.cudnn.benchmark`` on during the training epochs (module docstring)."""

    kind = "convolutions"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._users: bool | None = None  # the user's setting while the change is made

    @override
    def name(self, run: Run) -> str:
        return "cuDNN"

    @override
    def why_off(self, run: Run) -> str | None:
        if not self.on:
            return "cudnn_benchmark=False"
        if run.device.type != "cuda":
            return "the device is not CUDA"
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        if run.trainer.args.multi_scale:
            return (f"multi_scale={run.trainer.args.multi_scale} changes the image size from batch to batch "
                    "(each new size's convolutions would be timed)")
        return None

    @override
    def apply(self, run: Run) -> None:
        self._users = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True

    @override
    def rows(self, run: Run) -> list[Row]:
        among = (" among its deterministic algorithms (deterministic=True)"
                 if torch.backends.cudnn.deterministic else "")
        return [Row(self.kind, self.name(run), ON, "the training step's convolution algorithms timed by cuDNN"
                    f"{among}, once per shape (torch.backends.cudnn.benchmark during the training epochs; "
                    f"{self._users} for validation and after the run)")]

    @override
    def epoch_starts(self, run: Run) -> None:
        if self._users is not None:
            torch.backends.cudnn.benchmark = True

    @override
    def epoch_ends(self, run: Run) -> None:
        if self._users is not None:
            torch.backends.cudnn.benchmark = self._users

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        if self._users is not None:
            torch.backends.cudnn.benchmark = self._users
            self._users = None


__all__ = ["ConvAlgorithms"]
