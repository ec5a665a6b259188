"""Where FusedTraining acts: the backend the fused code runs on, and the precisions and
strategies it takes (any other leaves the whole run stock, with the reason)."""

from __future__ import annotations

import torch

import trainfuse
from trainfuse.clients import ON, Row
from trainfuse.lightning.changes.base import Change, Run

# Trainer(precision=...) values FusedTraining takes -> the 16-bit dtype of the autocast (None: none)
PRECISIONS: dict[str, torch.dtype | None] = {"32-true": None, "16-mixed": torch.float16,
                                             "bf16-mixed": torch.bfloat16}


class Backend(Change):
    """Changes nothing: says which code runs, the Triton kernels or torch's path (whose math is
    torch.optim's and torch.nn's own), and so what the rows below it describe."""

    kind = "backend"

    def rows(self, run: Run) -> list[Row]:
        setting = f"TRAINFUSE_BACKEND={trainfuse.backend()}"
        if run.kernels:
            where = "" if run.device.type == "cuda" else f", Triton's interpreter on {run.device.type}"
            detail = f"Triton kernels ({setting}{where})"
        elif not torch.cuda.is_available():
            detail = "no GPU: torch path (torch.optim's math, same results)"
        else:
            detail = f"torch path for {run.device.type} tensors ({setting})"
        return [Row(self.kind, str(run.device), ON, detail)]


class Precision(Change):
    """Acts under the precisions in :data:`PRECISIONS`; any other leaves the run stock."""

    kind = "precision"
    ends_run = True

    def name(self, run: Run) -> str:
        return f"precision={run.precision!r}"

    def why_not(self, run: Run) -> str | None:
        if run.precision not in PRECISIONS:
            return f"FusedTraining takes precision {', '.join(map(repr, PRECISIONS))}: nothing changed"
        return None


class Strategy(Change):
    """Acts under single-device and DDP strategies; sharded and engine-managed optimizers (FSDP,
    DeepSpeed, model parallel, XLA) leave the run stock."""

    kind = "strategy"
    ends_run = True

    def name(self, run: Run) -> str:
        return run.strategy

    def why_not(self, run: Run) -> str | None:
        if run.strategy not in ("single", "ddp"):
            return ("FusedTraining acts under single-device and DDP strategies (sharded or engine-managed "
                    "optimizers): nothing changed")
        return None


__all__ = ["PRECISIONS", "Backend", "Precision", "Strategy"]
