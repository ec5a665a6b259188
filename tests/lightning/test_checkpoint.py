"""Checkpoints written under FusedTraining are plain (with an EMA: in EMAWeightAveraging's layout),
and resuming continues the run exactly."""

import os

import pytest
import torch

from tests.lightning.helpers import assert_params_equal, fit, make_module, package, params
from trainfuse.lightning import FusedTraining

# EMAWeightAveraging and FusedTraining's EMA: the same average up to a float32 rounding or two per
# update (decay * ema + (1 - decay) * w against lerp)
EMA_TOL = 1e-6
# bf16-mixed with casts on the kernels (interpreter) against torch, 3 steps (test_training.py's)
KERNEL_TOL = 1e-5


def two_epochs(pl, root, callbacks, precision="32-true", optimizer="adamw", seed=0, ckpt_path=None,
               batches=2):
    """Two epochs of ``batches`` batches, saving a checkpoint at the end of each epoch into ``root``."""
    module = make_module(pl, optimizer, scheduler="step", seed=seed)
    saver = pl.callbacks.ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit(pl, module, batches, epochs=2, callbacks=[*callbacks, saver], precision=precision, clip=0.3,
        ckpt_path=ckpt_path)
    return module


def load(root, epoch=0):
    return torch.load(os.path.join(root, f"epoch={epoch}.ckpt"), weights_only=False)


@pytest.fixture
def fused_run(torch_path, tmp_path):
    pl = package()
    cb = FusedTraining(verbose=False, ema_decay=0.9)
    module = two_epochs(pl, tmp_path, [cb])
    return pl, tmp_path, module, cb


def test_checkpoint_state_dict_loads_into_the_plain_model(fused_run):
    pl, root, _, _ = fused_run
    ckpt = load(root)
    for key in ("state_dict", "current_model_state"):  # the EMA, and the live weights
        plain = make_module(pl)
        plain.load_state_dict(ckpt[key], strict=True)
        assert all(v.dtype in (torch.float32, torch.int64) for v in ckpt[key].values())


def test_checkpoint_with_ema_has_ema_weight_averagings_layout(fused_run):
    """The average as ``state_dict``, the live weights as ``current_model_state``, the update count
    in ``averaging_state``: what EMAWeightAveraging writes for the same run."""
    pl, root, _, _ = fused_run
    two_epochs(pl, root / "stock", [pl.callbacks.EMAWeightAveraging(decay=0.9)])
    ours, stock = load(root), load(root / "stock")
    assert int(ours["averaging_state"]["n_averaged"]) == int(stock["averaging_state"]["n_averaged"]) == 2
    for key in ("state_dict", "current_model_state"):
        assert ours[key].keys() == stock[key].keys()
        for k, v in stock[key].items():
            # integer buffers (BatchNorm's num_batches_tracked) are not averaged: the count in both
            # runs' live weights; AveragedModel's average of it truncates to an int on every update
            if key == "current_model_state" or v.is_floating_point():
                torch.testing.assert_close(ours[key][k], v, atol=EMA_TOL, rtol=0, msg=f"{key} {k}")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_checkpoint_optimizer_state_loads_into_torch_and_back(torch_path, tmp_path, optimizer):
    pl = package()
    two_epochs(pl, tmp_path, [FusedTraining(verbose=False)], optimizer=optimizer)
    saved = load(tmp_path)["optimizer_states"][0]
    plain = make_module(pl, optimizer)
    torch_opt = plain.configure_optimizers()
    torch_opt.load_state_dict(saved)
    assert torch_opt.state_dict()["state"].keys() == saved["state"].keys()
    # the checkpoint holds the states where training kept them (the GPU in a GPU run);
    # load_state_dict puts them on the plain module's params (the CPU)
    for idx, entry in torch_opt.state_dict()["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, saved["state"][idx][k].to(v.device)), (idx, k)


def test_resume_torch_path_is_exact(fused_run):
    pl, root, uninterrupted, _ = fused_run
    cb = FusedTraining(verbose=False, ema_decay=0.9)
    resumed = two_epochs(pl, root / "b", [cb], seed=5, ckpt_path=os.path.join(root, "epoch=0.ckpt"))
    assert resumed.lrs == uninterrupted.lrs[2:]
    assert_params_equal(params(resumed), params(uninterrupted))


def test_resume_restores_the_ema(fused_run):
    """The resumed run's last checkpoint is the uninterrupted run's: the same average, live
    weights and update count."""
    pl, root, _, _ = fused_run
    cb = FusedTraining(verbose=False, ema_decay=0.9)
    two_epochs(pl, root / "b", [cb], seed=5, ckpt_path=os.path.join(root, "epoch=0.ckpt"))
    a, b = load(root, 1), load(root / "b", 1)
    assert int(a["averaging_state"]["n_averaged"]) == int(b["averaging_state"]["n_averaged"]) == 4
    for key in ("state_dict", "current_model_state"):
        for k, v in a[key].items():
            assert torch.equal(b[key][k], v), f"{key} {k}"


def test_resume_on_kernels_with_casts_is_exact(kernels, tmp_path):
    """bf16-mixed with fuse_casts, clipping and EMA on the kernels: the checkpoint holds the
    float32 masters as weights and float32 states, so the resumed run repeats the same kernel
    math on the same values (measured equal; one float32 ulp per step allowed)."""
    pl = package()
    opts = dict(verbose=False, ema_decay=0.9, mlp=False, losses=False)
    first = FusedTraining(**opts)
    uninterrupted = two_epochs(pl, tmp_path, [first], precision="bf16-mixed", batches=1)
    assert {r.kind: r.action for r in first.report}["casts"] == "on"
    resumed = two_epochs(pl, tmp_path / "b", [FusedTraining(**opts)], precision="bf16-mixed", seed=5,
                         batches=1, ckpt_path=os.path.join(tmp_path, "epoch=0.ckpt"))
    for k, v in params(uninterrupted).items():
        ulp = torch.finfo(torch.float32).eps * v.abs().clamp_min(1e-3)
        assert ((params(resumed)[k] - v).abs() <= 2 * ulp).all(), k


def test_stock_checkpoint_resumes_under_fused_training(torch_path, tmp_path):
    pl = package()
    stock = two_epochs(pl, tmp_path, [])
    resumed = two_epochs(pl, tmp_path / "b", [FusedTraining(verbose=False)], seed=5,
                         ckpt_path=os.path.join(tmp_path, "epoch=0.ckpt"))
    assert_params_equal(params(resumed), params(stock))


@pytest.mark.parametrize("averaging", [False, True])
def test_fused_checkpoint_resumes_in_a_stock_run_as_ema_weight_averagings_does(fused_run, averaging):
    """A stock run resumes FusedTraining's checkpoint as it resumes EMAWeightAveraging's: without a
    callback from the average (its ``state_dict``), under EMAWeightAveraging from the live weights
    with the average continued."""
    pl, root, _, _ = fused_run
    two_epochs(pl, root / "stock", [pl.callbacks.EMAWeightAveraging(decay=0.9)])
    resumed = {}
    for name in ("stock", "ours"):
        ckpt = os.path.join(root / "stock" if name == "stock" else root, "epoch=0.ckpt")
        callbacks = [pl.callbacks.EMAWeightAveraging(decay=0.9)] if averaging else []
        resumed[name] = two_epochs(pl, root / f"resumed-{name}", callbacks, seed=5, ckpt_path=ckpt)
    # the two averages differ by float32 roundings (EMA_TOL), which the two AdamW steps after the
    # resume carry on at the same size
    assert_params_equal(params(resumed["ours"]), params(resumed["stock"]), atol=10 * EMA_TOL)


def test_checkpoint_saved_during_validation_holds_the_average_and_the_live_weights(torch_path, tmp_path):
    pl = package()
    seen = {}

    class SaveDuringValidation(pl.Callback):
        def on_validation_epoch_start(self, trainer, pl_module):
            seen["live"] = params(pl_module)  # before FusedTraining swaps the EMA in

        def on_validation_epoch_end(self, trainer, pl_module):
            seen["during"] = params(pl_module)  # the EMA, still swapped in
            trainer.save_checkpoint(tmp_path / "during.ckpt")

    fit(pl, make_module(pl), 2, val_every=2,
        callbacks=[SaveDuringValidation(), FusedTraining(verbose=False, ema_decay=0.9)])
    saved = torch.load(tmp_path / "during.ckpt", weights_only=False)
    assert not torch.equal(seen["during"]["head.weight"], seen["live"]["head.weight"])
    for k, v in seen["live"].items():
        assert torch.equal(saved["current_model_state"][k].float(), v), k
        assert torch.equal(saved["state_dict"][k].float(), seen["during"][k]), k


@pytest.mark.parametrize("path", ["torch_path", "kernels"])
def test_checkpoint_saved_after_the_fit_holds_the_average_and_the_final_live_weights(request, tmp_path, path):
    """After the fit the module holds the average; a checkpoint saved then (ModelCheckpoint's last
    one at train end, ``trainer.save_checkpoint``) still holds the live weights the fit ended with
    as ``current_model_state``, float32, and optimizer states in torch.optim's layout, so a fit
    resumed from it continues both. Compared with the same fit under EMAWeightAveraging (the
    average) and without averaging (the live weights)."""
    request.getfixturevalue(path)
    pl = package()
    tol = 0.0 if path == "torch_path" else KERNEL_TOL
    stock_average, stock_live, ours = make_module(pl), make_module(pl), make_module(pl)
    fit(pl, stock_average, 3, callbacks=[pl.callbacks.EMAWeightAveraging(decay=0.9)], precision="bf16-mixed")
    fit(pl, stock_live, 3, precision="bf16-mixed")
    cb = FusedTraining(verbose=False, ema_decay=0.9, mlp=False, losses=False)
    trainer = fit(pl, ours, 3, callbacks=[cb], precision="bf16-mixed")
    assert {r.kind: r.action for r in cb.report}["casts"] == ("on" if path == "kernels" else "skipped")
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", weights_only=False)
    assert int(saved["averaging_state"]["n_averaged"]) == 3
    for key, stock in (("state_dict", stock_average), ("current_model_state", stock_live)):
        for k, v in stock.state_dict().items():
            assert saved[key][k].dtype == v.dtype, (key, k)
            if key == "current_model_state" or v.is_floating_point():
                torch.testing.assert_close(saved[key][k], v, atol=max(tol, EMA_TOL), rtol=0, msg=f"{key} {k}")
    torch_opt = stock_live.configure_optimizers()
    torch_opt.load_state_dict(saved["optimizer_states"][0])
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in torch_opt.state.values())
