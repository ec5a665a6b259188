"""A fit that raises leaves the run as stock Lightning leaves it: Lightning calls ``on_exception``
(not ``teardown``) after a failure, and FusedTraining undoes every change there too."""

import pytest
import torch

from tests.lightning.helpers import (
    assert_params_equal,
    float16_mixed,
    make_module,
    make_trainer,
    package,
    params,
    run_fit,
)
from trainfuse.lightning import FusedTraining

# bf16-mixed and 16-mixed on the kernels (interpreter) against torch, 3 steps: as KERNEL_TOL in
# test_training.py
TOL = 1e-5


class Boom(RuntimeError):
    """The user's error, raised by the step."""


def failing_module(pl, step: str, at: int):
    """The test module whose ``training_step`` or ``validation_step`` raises at global step ``at``."""
    module = make_module(pl)
    own = getattr(module, step)

    def raising(*args, **kwargs):
        if module.global_step == at:
            raise Boom(f"{step} at step {at}")
        return own(*args, **kwargs)

    setattr(module, step, raising)
    return module


def failed_fit(pl, module, callbacks, precision, val_every=None):
    """A fit of 5 batches with clipping by norm that raises Boom; returns its Trainer."""
    fp16 = precision == "16-mixed"  # through the plugin: Lightning makes 16-mixed bf16-mixed on CPU
    trainer = make_trainer(pl, callbacks, precision=None if fp16 else precision, clip=0.5,
                           val_every=val_every, plugins=[float16_mixed(pl)] if fp16 else [])
    with pytest.raises(Boom):
        run_fit(trainer, module, 5, val=bool(val_every))
    return trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_training_step_that_raises_leaves_float32_weights_and_the_trainers_clipping(kernels, precision):
    pl = package()
    stock = failing_module(pl, "training_step", 3)
    stock_trainer = failed_fit(pl, stock, [], precision)
    ours = failing_module(pl, "training_step", 3)
    cb = FusedTraining(verbose=False, mlp=False, losses=False)
    trainer = failed_fit(pl, ours, [cb], precision)
    rows = {r.kind: r.action for r in cb.report}
    assert rows["casts"] == "on" and rows["clipping"] == "on"
    assert {p.dtype for p in ours.parameters()} == {p.dtype for p in stock.parameters()} == {torch.float32}
    assert_params_equal(params(stock), params(ours), atol=TOL, rtol=0)
    assert stock_trainer.gradient_clip_val == 0.5
    assert (trainer.gradient_clip_val, trainer.gradient_clip_algorithm) == \
        (stock_trainer.gradient_clip_val, stock_trainer.gradient_clip_algorithm)
    if precision == "16-mixed":
        assert rows["scaler"] == "swapped"
        scaler, stock_scaler = trainer.precision_plugin.scaler, stock_trainer.precision_plugin.scaler
        assert type(scaler) is type(stock_scaler) is torch.amp.GradScaler
        assert scaler.get_scale() == stock_scaler.get_scale()


def test_validation_that_raises_puts_the_live_weights_back(kernels):
    """The EMA is swapped in while validation runs; a validation_step that raises leaves the live
    weights in the module, float32, as a run without averaging has them. (EMAWeightAveraging
    would leave its average swapped in.)"""
    pl = package()
    stock = failing_module(pl, "validation_step", 2)
    failed_fit(pl, stock, [], "bf16-mixed", val_every=2)
    ours = failing_module(pl, "validation_step", 2)
    cb = FusedTraining(verbose=False, ema_decay=0.5, mlp=False, losses=False)
    failed_fit(pl, ours, [cb], "bf16-mixed", val_every=2)
    assert {r.kind: r.action for r in cb.report}["casts"] == "on"
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    assert_params_equal(params(stock), params(ours), atol=TOL, rtol=0)
