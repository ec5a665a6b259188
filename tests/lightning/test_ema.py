"""FusedTraining(ema_decay=...) against Lightning's EMAWeightAveraging in the same run."""

import warnings

import pytest
import torch
from torch import nn

from tests.lightning.helpers import (
    ACCELERATOR,
    BATCH,
    GPU_TOL,
    data,
    fit,
    float16_mixed,
    loaders,
    make_module,
    make_trainer,
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


def ema_callback(pl, name: str, decay: float = DECAY):
    """The averaging callback of the stock run (EMAWeightAveraging) or of ours (FusedTraining)."""
    if name == "stock":
        return pl.callbacks.EMAWeightAveraging(decay=decay)
    return FusedTraining(verbose=False, ema_decay=decay)


def stock_and_ours(pl, steps=4, val_every=None, **fit_kwargs):
    stock, ours = make_module(pl), make_module(pl)
    fit(pl, stock, steps, callbacks=[ema_callback(pl, "stock")], val_every=val_every, **fit_kwargs)
    cb = ema_callback(pl, "ours")
    fit(pl, ours, steps, callbacks=[cb], val_every=val_every, **fit_kwargs)
    return stock, ours, cb


def assert_same_average(ours, stock, atol: float = EMA_TOL) -> None:
    """The float entries of two modules' state_dicts: the averages both callbacks left in them."""
    averaged, ema = float_keys(stock.state_dict()), float_keys(ours.state_dict())
    assert set(ema) == set(averaged)
    for k, v in averaged.items():
        torch.testing.assert_close(ema[k], v, atol=atol, rtol=0, msg=k)


def test_ema_matches_ema_weight_averaging(torch_path):
    pl = package()
    stock, ours, cb = stock_and_ours(pl)
    assert {r.kind: r.action for r in cb.report}["ema"] == "on"
    # both callbacks copy their average into the module when training ends
    assert_same_average(ours, stock)
    plain = make_module(pl)
    fit(pl, plain, 4)
    assert not torch.equal(params(plain)["head.weight"], params(ours)["head.weight"])  # not the live weights


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
    trainer = pl.Trainer(accelerator=ACCELERATOR, devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                         limit_val_batches=1,
                         callbacks=[FusedTraining(verbose=False, ema_decay=DECAY), Probe()])
    loader = torch.utils.data.DataLoader(data(2), batch_size=BATCH)
    trainer.fit(module, loader, torch.utils.data.DataLoader(data(1, seed=3), batch_size=BATCH))
    for k, v in seen[True].items():  # seen on the Trainer's device, before on the CPU
        assert torch.equal(v.cpu(), before[k]), k


def test_test_after_fit_runs_on_the_ema(torch_path):
    """Both callbacks leave the average in the module: a test after the fit, with the fit's
    callback, runs on it and leaves the module as it was."""
    pl = package()
    results, before, after = {}, {}, {}
    for name in ("stock", "ours"):
        module = make_module(pl)
        cb = ema_callback(pl, name)
        fit(pl, module, 4, callbacks=[cb])
        trainer = pl.Trainer(accelerator=ACCELERATOR, devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[cb])
        module.test_step = module.validation_step
        module.val_losses.clear()
        before[name] = params(module)
        trainer.test(module, torch.utils.data.DataLoader(data(1, seed=7), batch_size=BATCH), verbose=False)
        results[name], after[name] = module.val_losses[0], params(module)
    torch.testing.assert_close(results["ours"], results["stock"], atol=1e-6, rtol=0)
    for k, v in before["ours"].items():
        assert torch.equal(after["ours"][k], v), k


def test_ema_on_kernels_matches_ema_weight_averaging(kernels):
    pl = package()
    stock, ours = make_module(pl), make_module(pl)
    fit(pl, stock, 2, callbacks=[pl.callbacks.EMAWeightAveraging(decay=DECAY)], precision="bf16-mixed")
    cb = FusedTraining(verbose=False, ema_decay=DECAY, mlp=False, losses=False)
    fit(pl, ours, 2, callbacks=[cb], precision="bf16-mixed")
    assert {r.kind: r.action for r in cb.report}["casts"] == "on"
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    assert_same_average(ours, stock, kernel_tol("bf16-mixed"))


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
    assert_same_average(ours, stock, kernel_tol("16-mixed"))


@pytest.mark.parametrize("where", ["the fit's Trainer", "a fresh Trainer"])
def test_validating_a_checkpoint_runs_on_that_checkpoints_ema(torch_path, tmp_path, where):
    """``trainer.validate(ckpt_path=...)`` evaluates the EMA the checkpoint was saved with, as under
    EMAWeightAveraging: on the Trainer that ran the fit (whose own EMA has moved on since) and in a
    fresh Trainer with a fresh callback."""
    pl = package()
    losses = {}
    for name in ("stock", "ours"):
        root = tmp_path / name
        saver = pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_last=True,
                                             filename="{epoch}")
        module = make_module(pl)
        trainer = fit(pl, module, 2, epochs=3, val_every=2, callbacks=[ema_callback(pl, name, 0.6), saver])
        for ckpt in ("epoch=0.ckpt", "last.ckpt"):
            if where == "a fresh Trainer":
                module = make_module(pl, seed=5)
                trainer = make_trainer(pl, [ema_callback(pl, name, 0.6)], val_every=2)
            module.val_losses.clear()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*(num_workers|outside the 'fit' stage).*")
                trainer.validate(module, loaders(2, val=True)[1], ckpt_path=root / ckpt, verbose=False)
            losses[name, ckpt] = torch.stack(module.val_losses)
    for ckpt in ("epoch=0.ckpt", "last.ckpt"):
        torch.testing.assert_close(losses["ours", ckpt], losses["stock", ckpt], atol=EMA_TOL, rtol=0,
                                   msg=ckpt)
    assert not torch.allclose(losses["stock", "epoch=0.ckpt"], losses["stock", "last.ckpt"])


def test_after_fit_the_module_holds_the_ema(torch_path, tmp_path):
    """EMAWeightAveraging copies the average into the module when training ends: its state_dict,
    ``trainer.predict``, a weights-only checkpoint and ``load_from_checkpoint`` all give the EMA.
    So do FusedTraining's."""
    pl = package()
    out = {}
    inputs = torch.utils.data.DataLoader(data(2, seed=7).tensors[0], batch_size=BATCH)
    for name in ("stock", "ours"):
        module = make_module(pl)
        trainer = fit(pl, module, 4, callbacks=[ema_callback(pl, name)])
        predicted = torch.cat(trainer.predict(module, inputs))
        path = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(path, weights_only=True)
        loaded = type(module).load_from_checkpoint(path, map_location="cpu", weights_only=False)
        out[name] = (float_keys(module.state_dict()), predicted, float_keys(loaded.state_dict()))
    (stock, stock_predicted, stock_loaded), (ours, ours_predicted, ours_loaded) = out["stock"], out["ours"]
    assert set(ours) == set(stock)
    for k in stock:
        torch.testing.assert_close(ours[k], stock[k], atol=EMA_TOL, rtol=0, msg=k)
        torch.testing.assert_close(ours_loaded[k], stock_loaded[k], atol=EMA_TOL, rtol=0, msg=k)
    torch.testing.assert_close(ours_predicted, stock_predicted, atol=1e-5, rtol=0)


VOCAB, WIDTH, CONTEXT = 16, 8, 6


def make_tied_module(pl):
    """A GPT-like LightningModule: token embedding, an MLP block, and a head whose weight is the
    embedding's (``head.weight is emb.weight``: one tensor under two state_dict keys)."""

    class TinyGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(VOCAB, WIDTH)
            nn.init.normal_(self.emb.weight, std=0.02)  # GPT-2's init: AdamW's steps move it visibly
            self.block = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.head.weight = self.emb.weight

        def training_step(self, batch, i):
            (tokens,) = batch
            h = self.emb(tokens[:, :-1])
            logits = self.head(h + self.block(h))
            return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return TinyGPT()


def token_batches(steps: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (steps * BATCH, CONTEXT), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=BATCH)


def assert_tied_keys_agree(checkpoint: dict, name: str) -> None:
    for key in ("state_dict", "current_model_state"):
        state = checkpoint[key]
        assert torch.equal(state["head.weight"], state["emb.weight"]), f"{name} {key}: the aliases differ"


@pytest.mark.cpu_training  # the checkpoint's keys are the point: on the CPU, torch's path, exact live weights
def test_tied_weights_checkpoint_matches_ema_weight_averaging(torch_path, tmp_path):
    """A head tied to the embedding: every checkpoint holds one value under both keys, the average
    in ``state_dict`` and the live weights in ``current_model_state``, as EMAWeightAveraging's
    does, so loading either puts that value into the tied tensor whichever key wins. Saved at the
    fit's last step by both callbacks, and after the fit by FusedTraining (compared with
    EMAWeightAveraging's save at the last step: after the fit its average is in the module, which
    it then saves as ``current_model_state`` too)."""
    pl = package()
    steps, saved = 4, {}

    class SaveAtLastStep(pl.Callback):  # listed after the averaging callback: after its update
        def __init__(self, name):
            self.name = name

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == steps:
                trainer.save_checkpoint(tmp_path / f"{self.name}.ckpt")

    for name in ("stock", "ours"):
        trainer = make_trainer(pl, [ema_callback(pl, name), SaveAtLastStep(name)], accelerator="cpu")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*(num_workers|does not have many workers).*")
            trainer.fit(make_tied_module(pl), token_batches(steps))
        saved[name] = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
    trainer.save_checkpoint(tmp_path / "ours after the fit.ckpt")
    saved["ours after the fit"] = torch.load(tmp_path / "ours after the fit.ckpt", weights_only=False)
    stock = saved["stock"]
    assert not torch.equal(stock["state_dict"]["emb.weight"], stock["current_model_state"]["emb.weight"])
    for name, checkpoint in saved.items():
        assert_tied_keys_agree(checkpoint, name)
        assert checkpoint["state_dict"].keys() == stock["state_dict"].keys()
        for k, v in stock["state_dict"].items():
            # the same decay schedule, lerp against multiply-add: a float32 rounding or two per
            # update on weights below 0.5 (ulp 6e-8), 4 updates within EMA_TOL (6e-8 measured)
            torch.testing.assert_close(checkpoint["state_dict"][k], v, atol=EMA_TOL, rtol=0,
                                       msg=f"{name} {k}")
        for k, v in stock["current_model_state"].items():
            # torch's path: FusedAdamW runs torch.optim's AdamW math, the live weights are equal
            assert torch.equal(checkpoint["current_model_state"][k], v), f"{name} {k}"
        loaded = make_tied_module(pl)
        loaded.load_state_dict(checkpoint["current_model_state"])
        assert torch.equal(loaded.head.weight, stock["current_model_state"]["emb.weight"]), name
