"""``FusedTraining(cuda_graphs=True)``: the model's forward and backward replayed from CUDA graphs
(:mod:`trainfuse.lightning.graph_targets` says which modules and why). Under DDP the replays accumulate
into the flat buffer of :class:`~trainfuse.lightning.changes.ddp.FlatAllReduce`, whose one
all-reduce per step takes the place of the hooks a replayed backward does not run.

The module's FusedMLP chains whose ``library`` is unset take the cuBLAS path for the run
(``library=True``): it costs less GPU time and more host time, which a replay does not pay. The
whole run (eager first calls, replays, validation) takes that one path; the chains are left unset
again at the end.
"""

from __future__ import annotations

from typing_extensions import override

from trainfuse.clients import ON, Row
from trainfuse.graphs import GraphedModule
from trainfuse.lightning import _compat, graph_targets
from trainfuse.lightning.changes.base import Change, Run
from trainfuse.lightning.changes.ddp import FlatAllReduce
from trainfuse.nn import FusedMLP


class Graphs(Change):
    """A GraphedModule in place of each target's forward; the module's own forward back at the end,
    on every path (first in the undo order, before the casts change the params' storage).

    Args:
        enabled: ``cuda_graphs``.
        installed: where the graphed modules go, by name (the callback keeps their statistics
            after the fit).
        ddp: under DDP, the change that owns the flat grads the graphs accumulate into.
    """

    kind = "graphs"

    def __init__(self, enabled: bool, installed: dict[str, GraphedModule], ddp: FlatAllReduce | None = None
                 ) -> None:
        self.enabled = enabled
        self.installed = installed
        self.ddp = ddp
        self.library: list[FusedMLP] = []  # the chains set to the cuBLAS path for the run

    @override
    def name(self, run: Run) -> str:
        return "cuda_graphs"

    @override
    def why_off(self, run: Run) -> str | None:
        return None if self.enabled else "cuda_graphs=False: forward and backward run eagerly"

    @override
    def why_not(self, run: Run) -> str | None:
        if _compat.compiled_by_trainer(run.module):
            return ("the LightningModule is compiled (trainer.fit(torch.compile(model))): dynamo would trace "
                    "the replays; torch.compile(mode='reduce-overhead') replays CUDA graphs of its own")
        if run.device.type != "cuda":
            return f"the run is on {run.device.type}: CUDA graphs need a CUDA device"
        if run.strategy in ("fsdp", "fsdp2"):
            return (f"{run.strategy}: its all-gathers and reduce-scatters run from hooks during forward and "
                    "backward, which a replay skips")
        if run.strategy not in ("single", "ddp"):
            return f"{run.strategy} strategy: FusedTraining graphs single-device and DDP runs"
        if run.strategy == "ddp" and (self.ddp is None or self.ddp.flat is None):
            return "DDP's own reducer runs from hooks during the backward, which a replayed backward skips"
        if not graph_targets.graph_targets(run.module):
            return "no forward on the LightningModule and no child module with trainable params"
        return None

    @override
    def apply(self, run: Run) -> None:
        ddp = self.ddp if run.strategy == "ddp" else None
        if ddp is not None:
            ddp.graphed = True
        self.installed.update(graph_targets.install(graph_targets.graph_targets(run.module),
                                             grads=None if ddp is None else ddp.grad_of, sync=ddp))
        self.library = [m for m in run.module.modules() if isinstance(m, FusedMLP) and m.library is None]
        for m in self.library:
            m.library = True

    @override
    def rows(self, run: Run) -> list[Row]:
        detail = ("forward + backward replayed from CUDA graphs per input shape (first batch of a shape "
                  "eager, second captured); loss, logging, hooks and optimizer step eager")
        if run.strategy == "ddp":
            detail += (f"; a step's last backward replays with DDP's all-reduce inside it, in "
                       f"{self.ddp.buckets()} buckets overlapping it, where one graphed forward reaches "
                       "every param")
        if self.library:
            detail += (f"; {len(self.library)} FusedMLP chain(s) on cuBLAS's matmuls where ReLU or linear "
                       "(less GPU time, more host time: the replays pay none of it)")
        return [Row(self.kind, ", ".join(self.installed), ON, detail)]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        for m in self.library:
            m.library = None
        self.library = []
        graph_targets.uninstall(self.installed)


__all__ = ["Graphs"]
