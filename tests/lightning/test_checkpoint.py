"""Checkpoints written under FusedTraining are plain, and resuming continues the run exactly."""

import os

import pytest
import torch

from tests.lightning.helpers import assert_params_equal, fit, make_module, package, params
from trainfuse.lightning import FusedTraining


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
    plain = make_module(pl)
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    assert all(v.dtype in (torch.float32, torch.int64) for v in ckpt["state_dict"].values())


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
    pl, root, _, first = fused_run
    cb = FusedTraining(verbose=False, ema_decay=0.9)
    two_epochs(pl, root / "b", [cb], seed=5, ckpt_path=os.path.join(root, "epoch=0.ckpt"))
    a, b = first._ema.state_dict(), cb._ema.state_dict()
    assert a["updates"] == b["updates"] == 4
    for k, v in a["state_dict"].items():
        assert torch.equal(b["state_dict"][k], v), k


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


def test_fused_checkpoint_resumes_in_a_stock_run(fused_run):
    pl, root, uninterrupted, _ = fused_run
    resumed = two_epochs(pl, root / "b", [], seed=5, ckpt_path=os.path.join(root, "epoch=0.ckpt"))
    # the stock run continues without the EMA; the weights follow the same path
    assert_params_equal(params(resumed), params(uninterrupted))


def test_checkpoint_saved_during_validation_holds_the_live_weights(torch_path, tmp_path):
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
    saved = torch.load(tmp_path / "during.ckpt", weights_only=False)["state_dict"]
    assert not torch.equal(seen["during"]["head.weight"], seen["live"]["head.weight"])
    for k, v in seen["live"].items():
        assert torch.equal(saved[k].float(), v), k
