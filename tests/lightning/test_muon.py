"""A LightningModule that pairs Muon (its matrices) with AdamW (the rest), as Muon's users do, and
steps both itself (manual optimization): FusedMuon built by the user, or torch.optim.Muon and AdamW
that FusedTraining swaps, train in a real Trainer.fit exactly as stock does (CPU: the torch path,
Muon's own ops); under 16-mixed's GradScaler the module's optimizers stay its own."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests._helpers import cuda
from tests.lightning.helpers import package
from trainfuse.lightning import FusedTraining
from trainfuse.optim.muon import FusedMuon

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch 2.9+")


def _fit(pl, muon_cls, fused=True, precision="32-true", accelerator="cpu", cuda_graphs=False, batches=4):
    class TwoOptimizers(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 16, bias=False), nn.GELU(), nn.Linear(16, 16, bias=False))
            self.head = nn.Linear(16, 2)
            self.automatic_optimization = False  # two optimizers, stepped by the module
            self.losses = []

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(loss.detach())
            opts = self.optimizers()
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opts[1], gradient_clip_val=0.5)  # Lightning's own clipping of the head
            for opt in opts:
                opt.step()

        def configure_optimizers(self):
            return [muon_cls(self.body.parameters(), lr=0.02),
                    torch.optim.AdamW(self.head.parameters(), lr=1e-3)]

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8 * batches, 8, generator=g),
                                          torch.randint(0, 2, (8 * batches,), generator=g))
    module, cb = TwoOptimizers(), FusedTraining(verbose=False, cuda_graphs=cuda_graphs)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision=precision, callbacks=[cb] if fused else [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|bottleneck|does not have many workers).*")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    module.report = {r.name: r for r in cb.report if r.kind == "optimizer"}
    module.graph_rows = [(r.name, r.action) for r in cb.report if r.kind == "optimizer_graph"]
    module.phase_stats = cb.optimizer_phase_stats
    module.optimizer_types = [type(o).__name__ for o in trainer.optimizers]
    module.steps_after = [vars(o).get("step") for o in trainer.optimizers]
    return module


def _assert_same_run(ours, ref) -> None:
    assert torch.equal(torch.stack(ours.losses), torch.stack(ref.losses))
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_fused_muon_with_adamw_trains_like_torch_muon(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    pl = package()
    _assert_same_run(_fit(pl, FusedMuon), _fit(pl, torch.optim.Muon, fused=False))


def test_a_users_muon_and_adamw_are_both_swapped_under_manual_optimization(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    pl = package()
    ours, ref = _fit(pl, torch.optim.Muon), _fit(pl, torch.optim.Muon, fused=False)
    assert ours.optimizer_types == ["FusedMuon", "FusedAdamW"] and ref.optimizer_types == ["Muon", "AdamW"]
    assert [r.action for r in ours.report.values()] == ["swapped", "swapped"]
    _assert_same_run(ours, ref)


def test_under_bf16_mixed_both_are_swapped_and_the_modules_clipping_runs_as_stock(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    pl = package()
    ours = _fit(pl, torch.optim.Muon, precision="bf16-mixed")
    ref = _fit(pl, torch.optim.Muon, fused=False, precision="bf16-mixed")
    assert ours.optimizer_types == ["FusedMuon", "FusedAdamW"]
    _assert_same_run(ours, ref)


@cuda
def test_manual_optimization_under_a_grad_scaler_keeps_the_modules_optimizers(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    pl = package()
    ours = _fit(pl, torch.optim.Muon, precision="16-mixed", accelerator="gpu")
    assert ours.optimizer_types == ["Muon", "AdamW"]
    row = ours.report["optimizer 0 (Muon)"]
    assert row.action == "skipped" and row.detail.startswith("manual optimization under a GradScaler")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (the GPU test below runs the replays)")
def test_each_optimizers_step_from_a_graph_trains_as_the_plain_steps(monkeypatch, kernels):
    """Manual optimization with Muon and AdamW swapped, each fused optimizer's ``opt.step()`` run
    by a graphed step of its own (on CPU every step runs eagerly: prepare_step, then the
    graph-safe launches): the same losses and weights as the fit without it, a row per optimizer,
    and the optimizers' own ``step`` back after the fit. (The gate asks for graphed modules, which
    a CPU run never has; opened here. The GPU test below runs it as users do.)"""
    from trainfuse.lightning.changes.phase import OptimizerPhase

    pl = package()
    plain = _fit(pl, torch.optim.Muon)
    monkeypatch.setattr(OptimizerPhase, "why_not", lambda self, run: None)
    ours = _fit(pl, torch.optim.Muon, cuda_graphs=True)
    assert ours.graph_rows == [("FusedMuon", "on"), ("FusedAdamW", "on")]
    assert ours.phase_stats == {"eager": 8, "captures": 0, "replays": 0}  # 4 steps of each
    assert ours.steps_after == [None, None]
    _assert_same_run(ours, plain)


def test_several_optimizers_and_manual_optimization_graph_each_fused_step(monkeypatch):
    from trainfuse.lightning.changes.base import Run
    from trainfuse.lightning.changes.phase import GRAPH_PHASE, OptimizerPhase
    from trainfuse.optim import FusedAdamW

    pl = package()

    class Installed:
        enabled = installed = True

    phase = OptimizerPhase(Installed())
    module = pl.LightningModule()
    trainer = pl.Trainer(accelerator="cpu", logger=False)
    run = Run(trainer, module, torch.device("cpu"), False, "32-true", "single")
    run.swapped = [FusedAdamW([nn.Parameter(torch.ones(2))]), FusedAdamW([nn.Parameter(torch.ones(2))])]
    run.all_swapped = True
    monkeypatch.delenv(GRAPH_PHASE, raising=False)
    assert phase.why_not(run) is None
    module.automatic_optimization = False
    assert phase.why_not(run) is None
    monkeypatch.setenv(GRAPH_PHASE, "0")
    assert phase.why_off(run) == f"{GRAPH_PHASE}=0"
    monkeypatch.delenv(GRAPH_PHASE)
    run.all_swapped = False
    assert phase.why_not(run) == "an optimizer of the run is not a fused one"


@cuda
def test_muon_and_adamw_steps_replayed_from_graphs_match_the_eager_steps_exactly(monkeypatch):
    """On a GPU, graphed forward and backward in both fits; Muon's and AdamW's steps eager in one,
    each replayed from a graph of its own in the other (after two steady eager steps), Lightning's
    clipping of the head's grads in between: the same losses and weights."""
    from trainfuse.lightning.changes.phase import GRAPH_PHASE

    pl = package()
    runs = {}
    for phase in ("0", "1"):
        monkeypatch.setenv(GRAPH_PHASE, phase)
        runs[phase] = _fit(pl, torch.optim.Muon, precision="bf16-mixed", accelerator="gpu", cuda_graphs=True,
                           batches=12)
    eager, graphed = runs["0"], runs["1"]
    assert graphed.graph_rows == [("FusedMuon", "on"), ("FusedAdamW", "on")]
    stats = graphed.phase_stats
    assert stats["captures"] >= 2 and stats["replays"] >= 2 * (12 - 4), stats
    _assert_same_run(graphed, eager)
