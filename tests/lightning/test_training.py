"""FusedTraining against the same Lightning run without it: optimizer swap, clipping, schedulers,
mixed precision, on the torch path (equal) and on the kernels (TRITON interpreter on CPU)."""

import pytest
import torch

import trainfuse
from tests.lightning.helpers import (
    ACCELERATOR,
    BATCH,
    PACKAGES,
    assert_params_equal,
    data,
    fit,
    float16_mixed,
    make_module,
    package,
    params,
)
from trainfuse.lightning import FusedTraining

# Kernel-path tolerances: float32 AdamW/SGD kernels match torch to a few ulp a step; after 3 steps
# of AdamW at lr 1e-2 (whose update divides by sqrt(v), amplifying ulp-level grad differences of
# near-zero grads) the params agree to 5e-7 (2e-6 allowed). Under bf16-mixed with fuse_casts the
# masters use the 2-ulp division and square root (trainfuse.optim.adam), and a weight rounded to
# bf16 on the other side of a tie moves the next loss by up to one bf16 ulp of an activation
# (1e-5 allowed; 6e-8 measured). 16-mixed (float16 weights, GradScaler) likewise.
KERNEL_TOL = {"32-true": 2e-6, "bf16-mixed": 1e-5, "16-mixed": 1e-5}


def run_pair(pl, optimizer="adamw", steps=4, callback=None, **fit_kwargs):
    # 16-mixed through the plugin: Lightning turns precision="16-mixed" into bf16-mixed on CPU
    fp16 = fit_kwargs.get("precision") == "16-mixed"
    if fp16:
        fit_kwargs["precision"] = None

    def plugins():  # a scaler of its own for each run
        return [float16_mixed(pl)] if fp16 else []

    ref, ours = make_module(pl, optimizer), make_module(pl, optimizer)
    fit(pl, ref, steps, plugins=plugins(), **fit_kwargs)
    cb = callback or FusedTraining(verbose=False)
    trainer = fit(pl, ours, steps, callbacks=[cb], plugins=plugins(), **fit_kwargs)
    return ref, ours, trainer, cb


@pytest.mark.parametrize("pkg", PACKAGES)
@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "musgd"])
def test_torch_path_run_equals_stock_run(torch_path, pkg, optimizer):
    if optimizer == "musgd":
        pytest.importorskip("ultralytics.optim")
    pl = package(pkg)
    ref, ours, trainer, cb = run_pair(pl, optimizer)
    fused = {"adamw": trainfuse.FusedAdamW, "adam": trainfuse.FusedAdam, "sgd": trainfuse.FusedSGD,
             "musgd": trainfuse.FusedMuSGD}
    expected = fused[optimizer]
    assert type(trainer.optimizers[0]) is expected
    assert torch.equal(torch.stack(ref.losses), torch.stack(ours.losses))
    assert_params_equal(params(ref), params(ours))
    assert type(ours.body).__name__ == "FusedMLP"
    assert type(ours.crit) is trainfuse.losses.BCEWithLogitsLoss


def test_swap_keeps_params_groups_user_keys_and_state():
    pl = package()
    module = make_module(pl, "adamw")
    seen = {}

    class Spy(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            opt.state[pl_module.head.bias]["sentinel"] = torch.ones(1)  # state present before the swap
            seen["groups"] = opt.param_groups
            seen["params"] = [list(g["params"]) for g in opt.param_groups]

        def on_train_start(self, trainer, pl_module):
            seen["after"] = trainer.optimizers[0]

    fit(pl, module, 1, callbacks=[Spy(), FusedTraining(verbose=False)])
    new = seen["after"]
    assert isinstance(new, trainfuse.FusedAdamW)
    assert new.param_groups is seen["groups"]
    ids = [[id(p) for p in g["params"]] for g in new.param_groups]
    assert ids == [[id(p) for p in g] for g in seen["params"]]
    assert [g["tag"] for g in new.param_groups] == ["decay", "no-decay"]
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    assert torch.equal(new.state[module.head.bias]["sentinel"], torch.ones(1))


@pytest.mark.parametrize("scheduler", ["step", "sequential"])
def test_schedulers_drive_the_new_optimizer(torch_path, scheduler):
    pl = package()
    ref, ours = make_module(pl, "adamw", scheduler), make_module(pl, "adamw", scheduler)
    fit(pl, ref, 5)
    trainer = fit(pl, ours, 5, callbacks=[FusedTraining(verbose=False)])
    assert ours.lrs == ref.lrs  # the LR the optimizer held at every step
    assert len({lr[0] for lr in ref.lrs}) > 2
    sched = trainer.lr_scheduler_configs[0].scheduler
    inner = getattr(sched, "_schedulers", [sched])
    assert all(s.optimizer is trainer.optimizers[0] for s in [sched, *inner])
    assert_params_equal(params(ref), params(ours))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_clipping_torch_path_equals_lightning_clipping(torch_path, algorithm, precision):
    pl = package()
    clip = 0.3 if algorithm == "norm" else 0.02
    ref, ours, trainer, _ = run_pair(pl, clip=clip, algorithm=algorithm, precision=precision)
    assert torch.equal(torch.stack(ref.losses), torch.stack(ours.losses))
    assert_params_equal(params(ref), params(ours))
    assert trainer.gradient_clip_val == clip  # restored at teardown
    assert ("grad_norm" in trainer.callback_metrics) == (algorithm == "norm")
    opt = trainer.optimizers[0]  # the step itself clipped, by the Trainer's algorithm
    assert (opt.max_grad_norm, opt.max_grad_value) == ((clip, None) if algorithm == "norm" else (None, clip))


def test_clipping_actually_clips():
    """The clipped run differs from the unclipped one: the clip value is small enough to bite."""
    pl = package()
    a, b = make_module(pl), make_module(pl)
    fit(pl, a, 3, callbacks=[FusedTraining(verbose=False)], clip=0.05)
    fit(pl, b, 3, callbacks=[FusedTraining(verbose=False)])
    assert not torch.equal(params(a)["head.weight"], params(b)["head.weight"])


def test_grad_norm_logged_is_the_pre_clip_norm():
    pl = package()
    norms = {}

    class Norm(pl.Callback):
        def on_after_backward(self, trainer, pl_module):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms[trainer.global_step] = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads]))

        def on_train_batch_end(self, trainer, pl_module, *args):
            norms[f"logged{trainer.global_step - 1}"] = trainer.callback_metrics["grad_norm"]

    fit(pl, make_module(pl), 3, callbacks=[FusedTraining(verbose=False), Norm()], clip=0.1)
    for step in range(3):
        torch.testing.assert_close(norms[f"logged{step}"], norms[step], rtol=1e-5, atol=0)


def test_grad_norm_logged_at_the_trainers_log_cadence():
    """grad_norm is logged only where the Trainer writes its logs: self.log costs more host time
    than the fused step itself."""
    pl = package()
    logged = {}

    class Seen(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            value = trainer.callback_metrics.get("grad_norm")
            logged[trainer.global_step] = None if value is None else float(value)

    fit(pl, make_module(pl), 5, callbacks=[FusedTraining(verbose=False), Seen()], clip=0.1,
        log_every_n_steps=2)
    # new values at steps 2 and 4 only; Lightning keeps showing the last one in between
    assert logged[1] is None
    assert logged[3] == logged[2] and logged[5] == logged[4] and logged[2] != logged[4]


@pytest.mark.parametrize(("precision", "algorithm"), [("32-true", "norm"), ("bf16-mixed", "norm"),
                                                      ("bf16-mixed", "value"), ("16-mixed", "norm"),
                                                      ("16-mixed", "value")])
def test_kernels_run_close_to_stock_run(kernels, precision, algorithm):
    pl = package()
    clip = 0.3 if algorithm == "norm" else 0.02
    cb = FusedTraining(verbose=False, mlp=False, losses=False)
    ref, ours, trainer, cb = run_pair(pl, steps=2, callback=cb, clip=clip, algorithm=algorithm,
                                      precision=precision)
    rows = {r.kind: r for r in cb.report}
    assert rows["backend"].detail.startswith("Triton kernels")
    assert rows["clipping"].detail.startswith(f"by {algorithm} inside the fused step")
    # both clippings run in the step on the unscaled grads: 16-bit weights under either precision
    assert rows["casts"].action == ("off" if precision == "32-true" else "on")
    tol = KERNEL_TOL[precision]
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(ref.losses), atol=tol, rtol=0)
    assert_params_equal(params(ref), params(ours), atol=tol, rtol=0)
    assert ours.body[0].weight.dtype == torch.float32  # float32 again after fit
    opt = trainer.optimizers[0]
    assert (opt.max_grad_norm, opt.max_grad_value) == ((clip, None) if algorithm == "norm" else (None, clip))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_kernels_musgd_with_clipping_close_to_stock_run(kernels, algorithm):
    """ultralytics' MuSGD returned by configure_optimizers: swapped, clipped inside the step."""
    pytest.importorskip("ultralytics.optim")
    pl = package()
    clip = 0.3 if algorithm == "norm" else 0.02
    ref, ours, trainer, _ = run_pair(pl, "musgd", clip=clip, algorithm=algorithm)
    opt = trainer.optimizers[0]
    assert type(opt) is trainfuse.FusedMuSGD and (opt.muon, opt.sgd) == (0.2, 1.0)
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(ref.losses), rtol=1e-5, atol=1e-5)
    assert_params_equal(params(ref), params(ours), atol=1e-5, rtol=1e-4)


def test_kernels_sgd_with_module_fusion(kernels):
    pl = package()
    ref, ours, trainer, cb = run_pair(pl, "sgd", steps=1, clip=0.3)
    assert [r.action for r in cb.report if r.kind in ("mlp", "loss")] == ["swapped", "swapped"]
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(ref.losses), atol=2e-6, rtol=0)
    assert_params_equal(params(ref), params(ours), atol=2e-6, rtol=0)


def test_learning_rate_monitor_follows_the_new_optimizer(torch_path, tmp_path):
    pl = package()
    logged = {}
    for name, callbacks in (("stock", []), ("ours", [FusedTraining(verbose=False)])):
        monitor = pl.callbacks.LearningRateMonitor(logging_interval="step")
        logger = pl.loggers.CSVLogger(tmp_path / name)
        trainer = pl.Trainer(accelerator=ACCELERATOR, devices=1, max_steps=4, logger=logger,
                             enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                             callbacks=[*callbacks, monitor])
        trainer.fit(make_module(pl, "adamw", "sequential"),
                    torch.utils.data.DataLoader(data(4), batch_size=BATCH))
        logged[name] = monitor.lrs
    # the monitor names its metrics by optimizer class: lr-FusedAdamW/pg1 for lr-AdamW/pg1
    assert list(logged["ours"]) == [k.replace("AdamW", "FusedAdamW") for k in logged["stock"]]
    assert list(logged["ours"].values()) == list(logged["stock"].values())
    assert len(logged["stock"]["lr-AdamW/pg1"]) == 4


def test_sparse_gradient_model_keeps_its_optimizer():
    """nn.Embedding(sparse=True) gets sparse grads, which the fused step does not take: the
    optimizer stays torch's, with the reason, and the run trains as without the callback."""
    pl = package()

    class Sparse(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(16, 8, sparse=True)
            self.head = torch.nn.Linear(8, 4)
            self.losses = []

        def training_step(self, batch, i):
            x, y = batch
            ids = (x[:, 0].abs() * 8).long().clamp(max=15)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self.head(self.embed(ids)), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ref, ours = Sparse(), Sparse()
    fit(pl, ref, 3)
    cb = FusedTraining(verbose=False)
    trainer = fit(pl, ours, 3, callbacks=[cb])
    row = next(r for r in cb.report if r.kind == "optimizer")
    assert (row.name, row.action) == ("optimizer 0 (SGD)", "skipped")
    assert "embed (sparse=True) gets sparse gradients" in row.detail
    assert type(trainer.optimizers[0]) is torch.optim.SGD
    assert torch.equal(torch.stack(ours.losses), torch.stack(ref.losses))
    assert_params_equal(params(ref), params(ours))
