"""FusedTraining(bn_silu=True): a CNN's BatchNorm2d + SiLU pairs in nn.Sequential run as one op in
a real Trainer.fit and the fit matches the one without (on torch's path bit for bit; on the kernels
within float32 rounding); the Sequentials get their own modules back after the fit, on every path;
pairs with hooks and compiled modules are left alone, with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.lightning.helpers import assert_params_equal, package, params
from trainfuse.lightning import FusedTraining
from trainfuse.nn.conv_block import BatchNormSiLU2d

STEPS, BATCH = 3, 4


def make_cnn(pl, seed: int = 0):
    """Two conv-BatchNorm-SiLU stages (one as torchvision's Conv2dNormActivation would be: a
    Sequential of its own), pooled into a linear head."""

    class CNN(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.SiLU())
            self.body = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False),
                                      nn.BatchNorm2d(8, momentum=0.03), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
            self.head = nn.Linear(8, 2)
            self.losses = []

        def forward(self, x):
            return self.head(self.body(self.stem(x)))

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return CNN()


def _fit(pl, module, *callbacks):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH, 3, 8, 8, generator=g),
                                          torch.randint(0, 2, (STEPS * BATCH,), generator=g))
    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return trainer


def _pair(pl):
    """The fit without ``bn_silu`` and with it; and the stem's module classes inside the latter."""
    ref, ours = make_cnn(pl), make_cnn(pl)
    _fit(pl, ref, FusedTraining(verbose=False))
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):
            seen.setdefault("stem", [type(m) for m in module.stem])

    cb = FusedTraining(verbose=False, bn_silu=True)
    _fit(pl, ours, cb, Spy())
    return ref, ours, cb, seen


def test_torch_path_fit_equals_the_fit_without_and_gives_the_modules_back(torch_path):
    pl = package()
    ref, ours, cb, seen = _pair(pl)
    assert seen["stem"] == [nn.Conv2d, BatchNormSiLU2d, nn.Identity]  # fused inside the fit
    rows = [r for r in cb.report if r.kind == "bn_silu"]
    assert [(r.name, r.action) for r in rows] == [("stem", "swapped"), ("body", "swapped")]
    assert rows[0].detail.startswith("1 pair(s), BatchNorm2d + SiLU: on the torch path")
    assert torch.equal(torch.stack(ours.losses), torch.stack(ref.losses))
    assert_params_equal(params(ref), params(ours))
    assert [type(m) for m in ours.stem] == [nn.Conv2d, nn.BatchNorm2d, nn.SiLU]  # given back
    assert type(ours.body[1]) is nn.BatchNorm2d and type(ours.body[2]) is nn.SiLU


def test_kernels_fit_close_to_the_fit_without(kernels):
    pl = package()
    ref, ours, cb, _ = _pair(pl)
    rows = [r for r in cb.report if r.kind == "bn_silu"]
    assert all(r.detail.startswith("1 pair(s), BatchNorm2d + SiLU: two launches") for r in rows)
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(ref.losses), rtol=1e-5, atol=1e-5)
    assert_params_equal(params(ref), params(ours), atol=1e-5, rtol=1e-4)


def test_off_by_default_and_pairs_with_hooks_are_left_alone(torch_path):
    pl = package()
    module = make_cnn(pl)
    cb = FusedTraining(verbose=False)
    _fit(pl, module, cb)
    assert not [r for r in cb.report if r.kind == "bn_silu"]
    module = make_cnn(pl)
    module.stem[1].register_forward_hook(lambda m, i, o: None)
    cb = FusedTraining(verbose=False, bn_silu=True)
    _fit(pl, module, cb)
    rows = {r.name: r for r in cb.report if r.kind == "bn_silu"}
    assert rows["stem"].action == "skipped" and "forward hooks" in rows["stem"].detail
    assert rows["body"].action == "swapped"


def test_bn_silu_must_be_a_bool():
    with pytest.raises(TypeError, match="FusedTraining: bn_silu must be a bool, got 1"):
        FusedTraining(bn_silu=1)
