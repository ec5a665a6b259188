"""Where FusedTraining acts: the backend the fused code runs on, and the precisions and
strategies it takes (any other leaves the whole run stock, with the reason)."""

from __future__ import annotations

import torch
from typing_extensions import override

import trainfuse
from trainfuse.clients import ON, Row
from trainfuse.lightning.changes.base import Change, Run
from trainfuse.optim.dtensors import shard_group

# Trainer(precision=...) values FusedTraining takes -> the 16-bit dtype of the autocast (None: none)
PRECISIONS: dict[str, torch.dtype | None] = {"32-true": None, "16-mixed": torch.float16,
                                             "bf16-mixed": torch.bfloat16}


class Backend(Change):
    """Changes nothing: says which code runs, the Triton kernels or torch's path (whose math is
    torch.optim's and torch.nn's own), and so what the rows below it describe."""

    kind = "backend"

    @override
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

    @override
    def name(self, run: Run) -> str:
        return f"precision={run.precision!r}"

    @override
    def why_not(self, run: Run) -> str | None:
        if run.precision not in PRECISIONS:
            return f"FusedTraining takes precision {', '.join(map(repr, PRECISIONS))}: nothing changed"
        return None


class Strategy(Change):
    """Acts under single-device, DDP, FSDP (``FSDPStrategy(use_orig_params=True)``, Lightning's
    default) and FSDP2 (``ModelParallelStrategy`` with ``fully_shard``) strategies; DeepSpeed,
    XLA and others leave the run stock, as do layouts the fused step cannot clip (hybrid
    sharding, tensor parallelism).

    Under FSDP and FSDP2 each rank's fused step takes its own shards; the clipping norm and
    GradScaler's inf check are every rank's (one all-reduce of the statistics on the device)."""

    kind = "strategy"
    ends_run = True

    @override
    def name(self, run: Run) -> str:
        return run.strategy

    @override
    def why_not(self, run: Run) -> str | None:
        if run.strategy in ("single", "ddp"):
            return None
        if run.strategy == "fsdp":
            return _why_not_fsdp(run)
        if run.strategy == "fsdp2":
            try:
                shard_group(list(run.module.parameters()), "FusedTraining")
            except ValueError as e:
                return f"{e}: nothing changed"
            return None
        return ("FusedTraining acts under single-device, DDP, FSDP and ModelParallel (FSDP2) strategies "
                "(engine-managed optimizers): nothing changed")

    @override
    def apply(self, run: Run) -> None:
        if run.strategy == "fsdp" and _sharding(run) != "NO_SHARD":
            run.shard_group = run.trainer.strategy.model.process_group

    @override
    def rows(self, run: Run) -> list[Row]:
        if run.strategy not in ("fsdp", "fsdp2"):
            return []
        return [Row(self.kind, run.strategy, ON, "each rank's fused step takes its own shards; the clipping "
                    "norm and the inf check cover every rank's grads (one all-reduce on the device)")]


def _sharding(run: Run) -> str:
    strategy = getattr(run.trainer.strategy, "sharding_strategy", None)
    return getattr(strategy, "name", str(strategy))


def _why_not_fsdp(run: Run) -> str | None:
    """Why FusedTraining leaves an FSDPStrategy run stock, or None."""
    if not run.trainer.strategy.kwargs.get("use_orig_params"):
        return ("FSDPStrategy(use_orig_params=False): the optimizers hold FSDP's flat parameters, not the "
                "module's; nothing changed")
    if "HYBRID" in _sharding(run):
        return (f"sharding_strategy={_sharding(run)}: the shards are replicated across groups, so no one "
                "process group sums a norm; nothing changed")
    return None


__all__ = ["PRECISIONS", "Backend", "Precision", "Strategy"]
