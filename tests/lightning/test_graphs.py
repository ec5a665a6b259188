"""FusedTraining(cuda_graphs=True): which modules are graphed, and, on a GPU, Trainer.fit runs whose
forward and backward replay from CUDA graphs against the same runs without graphs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests._helpers import cuda
from tests.lightning import helpers
from tests.lightning.helpers import (
    ACCELERATOR,
    PACKAGES,
    assert_params_equal,
    fit,
    make_module,
    package,
    params,
)
from trainfuse.amp import GradScaler
from trainfuse.lightning import FusedTraining, _compat
from trainfuse.lightning.changes.phase import GRAPH_PHASE
from trainfuse.lightning.graph_targets import graph_targets
from trainfuse.optim import FusedAdamW


def rows_of(cb):
    return {r.kind: r for r in cb.report}


def test_cuda_graphs_must_be_a_bool():
    with pytest.raises(TypeError, match="cuda_graphs must be a bool, got 1"):
        FusedTraining(cuda_graphs=1)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_graph_targets_are_the_forward_and_the_trainable_children(pkg):
    pl = package(pkg)

    class NoForward(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])  # a container: nothing to call
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.crit = nn.BCEWithLogitsLoss()  # no params
            self.head = nn.Linear(4, 1)

    class WithForward(NoForward):
        def forward(self, x):
            return self.head(self.body(x))

    assert [n for n, _ in graph_targets(NoForward())] == ["body", "head"]
    module = WithForward()
    targets = graph_targets(module)
    assert [n for n, _ in targets] == ["forward", "body", "head"] and targets[0][1] is module


@pytest.mark.skipif(ACCELERATOR != "cpu", reason="the CPU path")
@pytest.mark.parametrize("pkg", PACKAGES)
def test_cpu_run_says_why_it_is_eager_and_trains_as_without(pkg, torch_path):
    pl = package(pkg)
    ref, ours = make_module(pl), make_module(pl)
    fit(pl, ref, 4, callbacks=[FusedTraining(verbose=False)], clip=1.0)
    cb = FusedTraining(verbose=False, cuda_graphs=True)
    fit(pl, ours, 4, callbacks=[cb], clip=1.0)
    row = rows_of(cb)["graphs"]
    assert row.action == "skipped" and "CUDA graphs need a CUDA device" in row.detail
    assert cb.graph_stats == {} and "forward" not in ours.__dict__
    assert_params_equal(params(ref), params(ours))


# ---- on the GPU -----------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_graphed_fit_matches_the_eager_fit_exactly(precision, accumulate):
    """Two epochs of 6 steps with validation on the EMA, clipping by norm and a step scheduler,
    with and without gradient accumulation over 2 batches: graphs on against graphs off, same fused
    kernels. Accumulating runs keep the body a plain Sequential: FusedMLP adds a micro-batch's grad
    inside its weight-grad kernel eagerly, rounding once less than the graph's separate add."""
    pl = package()
    runs = {}
    for graphs in (False, True):
        module = make_module(pl, scheduler="step")
        plugins = [helpers.float16_mixed(pl)] if precision == "16-mixed" else []
        cb = FusedTraining(verbose=False, ema_decay=0.9, cuda_graphs=graphs, mlp=accumulate == 1)
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=False, callbacks=[cb],
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, gradient_clip_val=0.5,
                             precision=None if plugins else precision, plugins=plugins,
                             accumulate_grad_batches=accumulate, num_sanity_val_steps=0, limit_val_batches=2)
        loader = torch.utils.data.DataLoader(helpers.data(6), batch_size=8)
        val = torch.utils.data.DataLoader(helpers.data(2, seed=99), batch_size=8)
        trainer.fit(module, loader, val)
        runs[graphs] = (module, cb)
    (eager, _), (graphed, cb) = runs[False], runs[True]
    assert rows_of(cb)["graphs"].action == "on"
    for i, (a, b) in enumerate(zip(eager.losses, graphed.losses)):
        assert torch.equal(a, b), f"loss {i}: {a.item()} vs {b.item()}"
    assert torch.equal(torch.stack(eager.val_losses), torch.stack(graphed.val_losses))
    assert_params_equal(params(eager), params(graphed))
    stats = cb.graph_stats["forward"]
    assert stats.captures == 1 and stats.replays == 12 - 1 and stats.fallbacks == 0, (stats, cb.graph_reasons)
    assert cb.graph_reasons == {}
    assert "forward" not in graphed.__dict__  # the module's own forward is back after fit


@cuda
def test_graphed_children_of_a_module_without_forward():
    """training_step calls body, norm and head itself (and syncs with the host between them, which
    graphs of the modules allow): each child is graphed, and the run stays exact."""
    pl = package()

    def make():
        module = make_module(pl)
        del type(module).forward  # training_step below calls the children itself

        def training_step(batch, batch_idx):
            x, y = batch
            h = module.norm(module.body(x))
            if h.sum().item() > 1e9:  # a host sync outside any graphed module: no effect on graphs
                h = h * 0
            loss = module.crit(module.head(h).float(), y)
            module.losses.append(loss.detach().clone())
            return loss

        module.training_step = training_step
        return module

    eager, graphed = make(), make()
    fit(pl, eager, 6, callbacks=[FusedTraining(verbose=False)], accelerator="gpu", precision="bf16-mixed")
    cb = FusedTraining(verbose=False, cuda_graphs=True)
    fit(pl, graphed, 6, callbacks=[cb], accelerator="gpu", precision="bf16-mixed")
    assert rows_of(cb)["graphs"].name == "body, norm, head"
    for a, b in zip(eager.losses, graphed.losses):
        assert torch.equal(a, b)
    assert_params_equal(params(eager), params(graphed))
    assert all(s.replays == 5 and s.captures == 1 for s in cb.graph_stats.values()), \
        (cb.graph_stats, cb.graph_reasons)


@cuda
def test_graphed_fit_puts_relu_chains_on_cublas_and_matches_that_path_eagerly(monkeypatch):
    """Under cuda_graphs=True a FusedMLP ReLU chain takes the cuBLAS path for the whole run (its
    first eager calls, the replays, validation): equal to an eager run on that path, bit for bit;
    the chain's own setting (unset) is back after the fit."""
    pl = package()
    from trainfuse.nn import FusedMLP
    from trainfuse.nn.mlp import launches

    class Relu(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = FusedMLP([32, 64, 64, 16], activation="relu")
            self.losses, self.paths = [], []

        def training_step(self, batch, i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.body(x).float(), y)
            self.losses.append(loss.detach().clone())
            self.paths.append(self.body.library)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(6 * 64, 32, generator=g),
                                          torch.randn(6 * 64, 16, generator=g))
    runs = {}
    for graphs in (False, True):
        module = Relu()
        cb = FusedTraining(verbose=False, cuda_graphs=graphs)
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=False, callbacks=[cb],
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, precision="bf16-mixed")
        with monkeypatch.context() as m:
            if not graphs:  # the eager run on the cuBLAS path by the global switch
                m.setattr(launches.config, "library", True)
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
        runs[graphs] = (module, cb)
    (eager, _), (graphed, cb) = runs[False], runs[True]
    assert eager.paths == [None] * 12 and graphed.paths == [True] * 12
    assert graphed.body.library is None  # unset again after the fit
    assert "FusedMLP chain(s) on cuBLAS" in rows_of(cb)["graphs"].detail
    stats = cb.graph_stats["body"]  # no forward of its own: the chain is what is graphed
    assert stats.fallbacks == 0 and stats.replays >= 12 - 2, stats
    for a, b in zip(eager.losses, graphed.losses, strict=True):
        assert torch.equal(a, b)
    assert_params_equal(params(eager), params(graphed))


# ---- the optimizer step from a graph of its own -------------------------------------------------
@pytest.mark.skipif(ACCELERATOR != "cpu", reason="the CPU path")
def test_the_graphed_optimizer_step_follows_the_graphs_and_needs_the_graphed_backward(monkeypatch):
    pl = package()
    cb = FusedTraining(verbose=False)
    fit(pl, make_module(pl), 2, callbacks=[cb])
    assert rows_of(cb)["optimizer_graph"].detail == "cuda_graphs=False"
    cb = FusedTraining(verbose=False, cuda_graphs=True)
    fit(pl, make_module(pl), 2, callbacks=[cb])
    row = rows_of(cb)["optimizer_graph"]
    assert row.action == "skipped" and "no fixed addresses" in row.detail  # on CPU nothing is graphed
    assert cb.optimizer_phase_stats is None
    monkeypatch.setenv(GRAPH_PHASE, "0")
    cb = FusedTraining(verbose=False, cuda_graphs=True)
    fit(pl, make_module(pl), 2, callbacks=[cb])
    row = rows_of(cb)["optimizer_graph"]
    assert row.action == "off" and row.detail == f"{GRAPH_PHASE}=0"


@pytest.mark.skipif(ACCELERATOR != "cpu", reason="the CPU path")
@pytest.mark.parametrize(("optimizer", "float16"), [("adamw", False), ("sgd", False), ("adamw", True)],
                         ids=["adamw", "sgd", "adamw-16-mixed"])
def test_the_graphed_optimizer_step_trains_as_the_plain_step(monkeypatch, optimizer, float16, kernels):
    """The change's wiring in a real fit on CPU, where GraphedOptimizerStep runs every step eagerly
    (its graph-safe steps: prepare_step, then the launches reading the device tables): Lightning's
    closure, clipping inside the step, the step scheduler's lr, the EMA, and the optimizer's own
    step given back at the end, against the same fit without it; under 16-mixed the scaler's step
    and update as one fused step_and_update in the precision plugin's place, the plugin's own
    method back at the end. (Its gate, which asks for graphed modules that a CPU run never has, is
    opened here; the GPU test below runs it as users do.)"""
    from trainfuse.lightning.changes.phase import OptimizerPhase

    pl = package()
    runs = {}
    for graphed in (False, True):
        if graphed:
            monkeypatch.setattr(OptimizerPhase, "why_not", lambda self, run: None)
        module = make_module(pl, optimizer, scheduler="step")
        cb = FusedTraining(verbose=False, ema_decay=0.9, cuda_graphs=graphed)
        plugins = [helpers.float16_mixed(pl)] if float16 else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = fit(pl, module, 5, callbacks=[cb], clip=0.5, plugins=plugins)
        # the scheduler saw its optimizer stepped (torch warns when the step lost its mark)
        assert not [w for w in caught if "optimizer.step()" in str(w.message)]
        runs[graphed] = (module, cb, trainer)
    (plain, _, _), (ours, cb, trainer) = runs[False], runs[True]
    assert rows_of(cb)["optimizer_graph"].action == "on"
    assert cb.optimizer_phase_stats == {"eager": 5, "captures": 0, "replays": 0}
    for i, (a, b) in enumerate(zip(plain.losses, ours.losses)):
        assert torch.equal(a, b), f"loss {i}: {a.item()} vs {b.item()}"
    assert_params_equal(params(plain), params(ours))
    opt = trainer.optimizers[0]
    assert not opt.graph_safe
    # its step as before the fit: the LR scheduler's wrapper of the class's step
    assert vars(opt)["step"].__wrapped__ is type(opt).step
    assert "optimizer_step" not in vars(trainer.precision_plugin)
    if float16:
        assert "scale's update" in rows_of(cb)["optimizer_graph"].detail
        scaler = trainer.precision_plugin.scaler  # Lightning's again, with the run's scale
        assert type(scaler) is torch.amp.GradScaler and scaler.get_scale() == 2.0**16


@pytest.mark.skipif(ACCELERATOR != "cpu", reason="the CPU path")
def test_the_graphed_step_under_16_mixed_needs_trainfuses_scaler(monkeypatch):
    """16-mixed: the graph holds the scaler's step and update where the plugin's scaler is
    trainfuse's GradScaler; Lightning's own is refused by name."""
    from trainfuse.lightning.changes.base import Run
    from trainfuse.lightning.changes.phase import OptimizerPhase

    pl = package()
    trainer = helpers.make_trainer(pl, [], None, None, None, None, None, 1, ACCELERATOR,
                                   [helpers.float16_mixed(pl)], 1)
    run = Run(trainer, make_module(pl), torch.device("cpu"), False, "16-mixed", "single")

    class Installed:
        enabled = installed = True

    phase = OptimizerPhase(Installed())
    run.swapped, run.all_swapped = [FusedAdamW([nn.Parameter(torch.ones(2))])], True
    assert phase.why_not(run) == ("16-mixed with torch.amp.grad_scaler.GradScaler, not an enabled "
                                  "trainfuse.amp.GradScaler")
    trainer.precision_plugin.scaler = GradScaler("cpu")
    assert phase.why_not(run) is None
    trainer.precision_plugin.scaler = GradScaler("cpu", enabled=False)
    assert phase.why_not(run).startswith("16-mixed with trainfuse.amp")


@pytest.mark.parametrize("pkg", PACKAGES)
def test_after_closure_is_the_precision_plugins_step_between_closure_and_step(pkg):
    """``_compat.after_closure`` calls Lightning's private ``Precision._after_closure(model,
    optimizer)``: the hooks before the optimizer step and the plugin's clipping."""
    import inspect

    pl = package(pkg)
    method = pl.plugins.precision.Precision._after_closure
    assert list(inspect.signature(method).parameters) == ["self", "model", "optimizer"]
    seen = []

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(optimizer)

    trainer = fit(pl, make_module(pl), 1, callbacks=[Probe()])
    opt = trainer.optimizers[0]
    before = len(seen)
    _compat.after_closure(trainer.precision_plugin, trainer.lightning_module, opt)
    assert seen[before:] == [opt]


@cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_the_optimizer_step_replayed_from_a_graph_matches_the_eager_step_exactly(monkeypatch, precision):
    """Graphed forward and backward in both runs; the optimizer step eager in one, replayed from a
    graph of its own in the other (after two steady eager steps): the same losses, weights and EMA,
    with clipping, a step scheduler and validation on the EMA."""
    pl = package()
    runs = {}
    for phase in (False, True):
        monkeypatch.setenv(GRAPH_PHASE, "1" if phase else "0")
        module = make_module(pl, scheduler="step")
        cb = FusedTraining(verbose=False, ema_decay=0.9, cuda_graphs=True)
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=False, callbacks=[cb],
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, gradient_clip_val=0.5, precision=precision,
                             num_sanity_val_steps=0, limit_val_batches=2)
        loader = torch.utils.data.DataLoader(helpers.data(6), batch_size=8)
        val = torch.utils.data.DataLoader(helpers.data(2, seed=99), batch_size=8)
        trainer.fit(module, loader, val)
        runs[phase] = (module, cb)
    (eager, _), (graphed, cb) = runs[False], runs[True]
    assert rows_of(cb)["optimizer_graph"].action == "on"
    stats = cb.optimizer_phase_stats
    assert stats["captures"] >= 1 and stats["replays"] >= 12 - 4, stats
    for i, (a, b) in enumerate(zip(eager.losses, graphed.losses)):
        assert torch.equal(a, b), f"loss {i}: {a.item()} vs {b.item()}"
    assert torch.equal(torch.stack(eager.val_losses), torch.stack(graphed.val_losses))
    assert_params_equal(params(eager), params(graphed))
