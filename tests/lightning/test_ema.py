"""FusedTraining(ema_decay=...) against Lightning's EMAWeightAveraging in the same run."""

import pytest
import torch

from tests.lightning.helpers import (
    ACCELERATOR,
    BATCH,
    GPU_TOL,
    data,
    fit,
    float16_mixed,
    make_module,
    package,
    params,
)
from trainfuse.lightning import FusedTraining

DECAY = 0.8
# EMAWeightAveraging computes decay * ema + (1 - decay) * w, FusedEMA lerp(ema, w, 1 - decay):
# the same value up to a float32 rounding or two per update
EMA_TOL = 1e-6


def kernel_tol(precision: str) -> float:
    """EMA_TOL where the kernels run through the interpreter (its float32 math rounds as torch's
    CPU ops do); on a GPU the compiled kernels' runs differ from torch's as in test_gpu.py
    (GPU_TOL), and so do their averages."""
    return GPU_TOL[precision] if ACCELERATOR == "gpu" else EMA_TOL


def float_keys(sd):
    return {k: v for k, v in sd.items() if v.is_floating_point()}


def ema_cpu(cb) -> dict[str, torch.Tensor]:
    """The EMA, on the CPU: it stays where training ran, while Lightning's teardown moves the
    module (the stock run's average included) to the CPU."""
    return {k: v.cpu() for k, v in cb._ema.state_dict()["state_dict"].items()}


def stock_and_ours(pl, steps=4, val_every=None, **fit_kwargs):
    stock, ours = make_module(pl), make_module(pl)
    averaging = pl.callbacks.EMAWeightAveraging(decay=DECAY)
    fit(pl, stock, steps, callbacks=[averaging], val_every=val_every, **fit_kwargs)
    cb = FusedTraining(verbose=False, ema_decay=DECAY)
    fit(pl, ours, steps, callbacks=[cb], val_every=val_every, **fit_kwargs)
    return stock, ours, cb


def test_ema_matches_ema_weight_averaging(torch_path):
    pl = package()
    stock, ours, cb = stock_and_ours(pl)
    # EMAWeightAveraging copies its average into the model when training ends
    averaged = float_keys(stock.state_dict())
    assert cb._ema.state_dict()["updates"] == 4
    ema = ema_cpu(cb)
    assert set(ema) == set(averaged)
    for k, v in averaged.items():
        torch.testing.assert_close(ema[k], v, atol=EMA_TOL, rtol=0, msg=k)
    live = params(ours)
    assert not torch.equal(live["head.weight"], ema["head.weight"])  # not the weights


def test_validation_runs_on_the_ema_and_training_on_the_live_weights(torch_path):
    pl = package()
    stock, ours, cb = stock_and_ours(pl, steps=4, val_every=2)
    assert len(ours.val_losses) == len(stock.val_losses) == 4
    torch.testing.assert_close(torch.stack(ours.val_losses), torch.stack(stock.val_losses), atol=1e-6, rtol=0)
    # training losses match the stock run's: the swap back after validation restored the live weights
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(stock.losses), atol=1e-6, rtol=0)


def test_no_swap_before_the_first_update(torch_path):
    """The sanity check validates before any EMA update: it must see the live weights (Lightning
    #21724 swaps in the average before it exists)."""
    pl = package()
    seen = {}

    class Probe(pl.Callback):
        def on_validation_epoch_start(self, trainer, pl_module):
            seen.setdefault(trainer.sanity_checking, params(pl_module))

    module = make_module(pl)
    before = params(module)
    trainer = pl.Trainer(accelerator=ACCELERATOR, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                         limit_val_batches=1,
                         callbacks=[FusedTraining(verbose=False, ema_decay=DECAY), Probe()])
    loader = torch.utils.data.DataLoader(data(2), batch_size=BATCH)
    trainer.fit(module, loader, torch.utils.data.DataLoader(data(1, seed=3), batch_size=BATCH))
    for k, v in seen[True].items():  # seen on the Trainer's device, before on the CPU
        assert torch.equal(v.cpu(), before[k]), k


def test_test_runs_on_the_ema(torch_path):
    pl = package()
    stock, ours, cb = stock_and_ours(pl)
    # after a GPU fit, Lightning's teardown .cpu() and the test's .to(device) give the module new
    # buffer tensors (its Parameters stay): the swap must reach the module's tensors of now.
    # .double().float() does the same on the CPU (same values, new buffers)
    old_mean = ours.norm.running_mean
    ours.double().float()
    assert ours.norm.running_mean is not old_mean
    results = {}
    live = params(ours)
    for name, module in (("stock", stock), ("ours", ours)):
        trainer = pl.Trainer(accelerator=ACCELERATOR, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[cb] if name == "ours" else [])
        module.test_step = module.validation_step
        module.val_losses.clear()
        trainer.test(module, torch.utils.data.DataLoader(data(1, seed=7), batch_size=BATCH), verbose=False)
        results[name] = module.val_losses[0]
    # stock holds the average in its weights after fit; ours swaps it in for the test
    torch.testing.assert_close(results["ours"], results["stock"], atol=1e-6, rtol=0)
    for k, v in params(ours).items():  # the live weights are back after the test epoch
        assert torch.equal(v, live[k]), k


def test_ema_on_kernels_matches_ema_weight_averaging(kernels):
    pl = package()
    stock, ours = make_module(pl), make_module(pl)
    fit(pl, stock, 2, callbacks=[pl.callbacks.EMAWeightAveraging(decay=DECAY)], precision="bf16-mixed")
    cb = FusedTraining(verbose=False, ema_decay=DECAY, mlp=False, losses=False)
    fit(pl, ours, 2, callbacks=[cb], precision="bf16-mixed")
    assert {r.kind: r.action for r in cb.report}["casts"] == "on"
    ema = ema_cpu(cb)
    for k, v in float_keys(stock.state_dict()).items():
        torch.testing.assert_close(ema[k], v, atol=kernel_tol("bf16-mixed"), rtol=0, msg=k)


@pytest.mark.parametrize("averaging", ["EMAWeightAveraging", "WeightAveraging"])
def test_lightning_weight_averaging_alongside_ema_is_refused(averaging):
    pl = package()
    other = getattr(pl.callbacks, averaging)()
    with pytest.raises(ValueError, match=f"FusedTraining\\(ema_decay=0.8\\) and {averaging}"):
        fit(pl, make_module(pl), 1, callbacks=[FusedTraining(verbose=False, ema_decay=DECAY), other])


def test_skipped_step_under_16_mixed_matches_ema_weight_averaging(kernels):
    """An inf loss at step 1 under 16-mixed (float16 weights with float32 masters, GradScaler):
    the step is skipped (the Adam step count stays at 3 of 4, the scale halves as in the stock run)
    and the EMA moves toward the unchanged weights on it, as EMAWeightAveraging does (it updates
    after every optimizer step, skipped or not)."""
    pl = package()
    stock, ours = make_module(pl), make_module(pl)
    stock.inf_at = ours.inf_at = 1
    stock_trainer = fit(pl, stock, 4, callbacks=[pl.callbacks.EMAWeightAveraging(decay=DECAY)], clip=1.0,
                        plugins=[float16_mixed(pl)])
    cb = FusedTraining(verbose=False, ema_decay=DECAY, mlp=False, losses=False)
    trainer = fit(pl, ours, 4, callbacks=[cb], clip=1.0, plugins=[float16_mixed(pl)])
    rows = {r.kind: r.action for r in cb.report}
    assert rows["casts"] == "on" and rows["scaler"] == "swapped"
    assert not torch.isfinite(ours.losses[1]) and not torch.isfinite(stock.losses[1])
    assert trainer.precision_plugin.scaler.get_scale() == stock_trainer.precision_plugin.scaler.get_scale()
    assert {float(s["step"]) for s in trainer.optimizers[0].state.values()} == {3.0}
    ema = ema_cpu(cb)
    for k, v in float_keys(stock.state_dict()).items():  # EMAWeightAveraging leaves the average in
        torch.testing.assert_close(ema[k], v, atol=kernel_tol("16-mixed"), rtol=0, msg=k)
