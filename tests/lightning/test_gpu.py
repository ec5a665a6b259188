"""FusedTraining on a CUDA GPU: the compiled kernels against stock Lightning runs, 16-mixed with
GradScaler, and a step GradScaler skips."""

import os

import pytest
import torch

import trainfuse
from tests._helpers import cuda
from tests.lightning.helpers import GPU_TOL, assert_params_equal, fit, make_module, package, params
from trainfuse.lightning import FusedTraining

pytestmark = cuda
# SGD (lr 0.1, Nesterov momentum 0.9) passes a grad difference e into the weights linearly: over the
# 4 steps the grad of step 1 moves a weight by lr * (1.9 + 0.81 + 0.73 + 0.66) ~ 0.41 e, where
# AdamW's normalized update (lr * m / sqrt(v)) barely moves with it. Under 16-bit precision the
# weight-grad GEMMs read 16-bit activations and output grads, and FusedMLP's Triton kernels
# accumulate in another order than cuBLAS: one flipped bf16 rounding (2^-8 relative) of a batch
# term of ~0.2 changes a grad by ~1e-3 through the batch sum's cancellation, a weight by ~4e-4
SGD_16BIT_TOL = 4e-4


def tolerance(precision: str, optimizer: str) -> float:
    if optimizer == "sgd" and precision != "32-true":
        return SGD_16BIT_TOL
    return GPU_TOL[precision]


def assert_same_average(ours, stock, atol: float) -> None:
    """The float entries of two modules' state_dicts: the averages both callbacks left in them."""
    for k, v in stock.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(ours.state_dict()[k], v, atol=atol, rtol=0, msg=k)


def gpu_pair(pl, optimizer="adamw", steps=4, callback=None, stock_callbacks=(), **kw):
    ref, ours = make_module(pl, optimizer), make_module(pl, optimizer)
    fit(pl, ref, steps, callbacks=list(stock_callbacks), accelerator="gpu", **kw)
    cb = callback or FusedTraining(verbose=False)
    trainer = fit(pl, ours, steps, callbacks=[cb], accelerator="gpu", **kw)
    return ref, ours, trainer, cb


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_gpu_run_close_to_stock_run(precision, algorithm, optimizer):
    pl = package()
    clip = 0.3 if algorithm == "norm" else 0.02
    ref, ours, trainer, cb = gpu_pair(pl, optimizer, clip=clip, algorithm=algorithm, precision=precision)
    rows = {r.kind: r for r in cb.report}
    assert rows["backend"].detail.startswith("Triton kernels")
    assert rows["casts"].action == ("off" if precision == "32-true" else "on")
    assert rows["clipping"].detail.startswith(f"by {algorithm} inside the fused step")
    if precision == "16-mixed":
        assert rows["scaler"].action == "swapped"
        assert type(trainer.precision_plugin.scaler) is torch.amp.GradScaler  # restored at teardown
    tol = tolerance(precision, optimizer)
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(ref.losses), atol=tol, rtol=0)
    assert_params_equal(params(ref), params(ours), atol=tol, rtol=0)
    assert trainer.gradient_clip_val == clip


def test_gpu_ema_and_validation_match_ema_weight_averaging():
    pl = package()
    ref, ours, _, _ = gpu_pair(pl, callback=FusedTraining(verbose=False, ema_decay=0.8),
                                stock_callbacks=[pl.callbacks.EMAWeightAveraging(decay=0.8)],
                                precision="bf16-mixed", clip=1.0, val_every=2)
    torch.testing.assert_close(torch.stack(ours.val_losses), torch.stack(ref.val_losses), atol=1e-3, rtol=0)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    assert_same_average(ours, ref, GPU_TOL["bf16-mixed"])


def test_gpu_skipped_step_under_16_mixed_matches_lightning():
    """An inf loss at step 1: GradScaler skips that step in both runs (weights, Adam states and the
    step count stay), the scale halves, and the EMA moves toward the unchanged weights, as
    EMAWeightAveraging does (it updates after every optimizer step, skipped or not; the fused
    kernel's EMA fold runs on a skipped step too, toward the unchanged masters)."""
    pl = package()
    ref, ours = make_module(pl), make_module(pl)
    ref.inf_at = ours.inf_at = 1
    ref_trainer = fit(pl, ref, 4, callbacks=[pl.callbacks.EMAWeightAveraging(decay=0.8)], accelerator="gpu",
                      precision="16-mixed", clip=1.0)
    cb = FusedTraining(verbose=False, ema_decay=0.8)
    trainer = fit(pl, ours, 4, callbacks=[cb], accelerator="gpu", precision="16-mixed", clip=1.0)
    assert not torch.isfinite(ours.losses[1]) and not torch.isfinite(ref.losses[1])
    assert trainer.precision_plugin.scaler.get_scale() == ref_trainer.precision_plugin.scaler.get_scale()
    steps = {float(s["step"]) for s in trainer.optimizers[0].state.values() if "step" in s}
    assert steps == {3.0}
    assert_same_average(ours, ref, GPU_TOL["16-mixed"])  # both callbacks leave their average in


def test_gpu_resume_with_casts_is_exact(tmp_path):
    pl = package()

    def run(root, seed, ckpt_path=None):
        module = make_module(pl, scheduler="step", seed=seed)
        saver = pl.callbacks.ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1,
                                             filename="{epoch}")
        fit(pl, module, 2, epochs=2, callbacks=[FusedTraining(verbose=False, ema_decay=0.9), saver],
            precision="bf16-mixed", clip=0.3, ckpt_path=ckpt_path, accelerator="gpu")
        return module

    a = run(tmp_path, 0)
    b = run(tmp_path / "b", 5, os.path.join(tmp_path, "epoch=0.ckpt"))
    for k, v in params(a).items():
        ulp = torch.finfo(torch.float32).eps * v.abs().clamp_min(1e-3)
        assert ((params(b)[k] - v).abs() <= 2 * ulp).all(), k


def test_gpu_fused_optimizer_and_clipping_is_what_lightning_refuses():
    """Stock Lightning raises for a fused optimizer with gradient_clip_val under bf16-mixed; with
    FusedTraining the same Trainer settings run."""
    pl = package()
    module = make_module(pl)
    module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(pl, module, 1, accelerator="gpu", precision="bf16-mixed", clip=1.0)
    trainer = fit(pl, make_module(pl), 2, callbacks=[FusedTraining(verbose=False)], accelerator="gpu",
                  precision="bf16-mixed", clip=1.0)
    assert isinstance(trainer.optimizers[0], trainfuse.FusedAdamW)
