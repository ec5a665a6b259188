"""Tiny Lightning runs for the FusedTraining tests: the same fit with and without the callback."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch import nn

ACCELERATOR = "gpu" if torch.cuda.is_available() else "cpu"  # the suite runs again on a GPU
PACKAGES = [name for name in ("lightning.pytorch", "pytorch_lightning")
            if importlib.util.find_spec(name.split(".")[0]) is not None]
IN, HIDDEN, OUT, BATCH = 8, 16, 4, 8
# the compiled kernels against torch on one GPU, 4 steps of AdamW at lr 1e-2: float32 a few ulp
# per step (amplified for near-zero grads by Adam's normalization), 16-bit runs additionally by the
# masters' 2-ulp division/square root and 16-bit rounding ties; 16-mixed with value clipping (cast
# weights, float16 grads through FusedMLP's matmuls) reached 1.3e-4 on one near-zero-grad bias
GPU_TOL = {"32-true": 1e-5, "bf16-mixed": 1e-4, "16-mixed": 2.5e-4}


def package(name: str = "lightning.pytorch"):
    if name not in PACKAGES:
        pytest.skip(f"{name} is not installed")
    return importlib.import_module(name)


def data(steps: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """A fixed stream of ``steps`` batches (the labels depend on the inputs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * BATCH, IN, generator=g)
    y = (x[:, :OUT] + 0.3 * torch.randn(steps * BATCH, OUT, generator=g) > 0).float()
    return torch.utils.data.TensorDataset(x, y)


def make_module(pl, optimizer: str = "adamw", scheduler: str | None = None, seed: int = 0, **opt_kwargs):
    """A LightningModule of ``pl``: an MLP body (Linear/GELU Sequential), a head, BCEWithLogitsLoss,
    a BatchNorm buffer; records every training loss and every LR the optimizer held."""

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
            self.norm = nn.BatchNorm1d(HIDDEN)
            self.head = nn.Linear(HIDDEN, OUT)
            self.crit = nn.BCEWithLogitsLoss()
            self.losses, self.lrs, self.val_losses = [], [], []
            self.inf_at = None

        def forward(self, x):
            return self.head(self.norm(self.body(x)))

        def training_step(self, batch, i):
            x, y = batch
            loss = self.crit(self(x).float(), y)
            if self.global_step == self.inf_at:  # an overflow GradScaler must skip
                loss = loss * float("inf")
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.lrs.append([g["lr"] for g in optimizer.param_groups])

        def validation_step(self, batch, i):
            x, y = batch
            self.val_losses.append(self.crit(self(x).float(), y).detach().clone())

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            groups = [{"params": decay, "tag": "decay"},
                      {"params": rest, "weight_decay": 0.0, "tag": "no-decay"}]
            if optimizer == "adamw":
                opt = torch.optim.AdamW(groups, lr=opt_kwargs.pop("lr", 1e-2), weight_decay=0.1, **opt_kwargs)
            elif optimizer == "adam":
                opt = torch.optim.Adam(groups, lr=opt_kwargs.pop("lr", 1e-2), weight_decay=0.01, **opt_kwargs)
            elif optimizer == "sgd":
                opt = torch.optim.SGD(groups, lr=opt_kwargs.pop("lr", 0.1), momentum=0.9, nesterov=True,
                                      weight_decay=1e-3, **opt_kwargs)
            elif optimizer == "rmsprop":
                opt = torch.optim.RMSprop(groups, lr=1e-3)
            elif optimizer == "musgd":  # ultralytics' layout: Muon on the matrices, SGD on the rest
                from ultralytics.optim import MuSGD

                muon = [p for p in self.parameters() if p.ndim >= 2]
                sgd = [p for p in self.parameters() if p.ndim < 2]
                opt = MuSGD([{"params": muon, "use_muon": True, "weight_decay": 1e-3, "tag": "muon"},
                             {"params": sgd, "tag": "sgd"}], lr=opt_kwargs.pop("lr", 0.05), momentum=0.9,
                            nesterov=True, muon=0.2, sgd=1.0, **opt_kwargs)
            else:
                raise ValueError(optimizer)
            if scheduler is None:
                return opt
            if scheduler == "step":
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            else:
                sched = torch.optim.lr_scheduler.SequentialLR(
                    opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=2),
                          torch.optim.lr_scheduler.ExponentialLR(opt, 0.7)], milestones=[2])
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Tiny()


def make_trainer(pl, callbacks=(), precision=None, clip=None, algorithm=None, val_every: int | None = None,
                 root=None, epochs: int = 1, accelerator: str = ACCELERATOR, plugins=(),
                 log_every_n_steps: int = 1):
    """The Trainer :func:`fit` runs: ``epochs`` epochs, validation every ``val_every`` batches."""
    return pl.Trainer(plugins=list(plugins),
        accelerator=accelerator, devices=1, max_epochs=epochs, precision=precision, logger=False,
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm, callbacks=list(callbacks), num_sanity_val_steps=0,
        val_check_interval=val_every, limit_val_batches=2 if val_every else 0, default_root_dir=root,
        log_every_n_steps=log_every_n_steps)


def loaders(steps: int, data_seed: int = 0, val: bool = False):
    """The training batches of :func:`fit` and, with ``val``, its two validation batches."""
    loader = torch.utils.data.DataLoader(data(steps, data_seed), batch_size=BATCH)
    return loader, torch.utils.data.DataLoader(data(2, seed=99), batch_size=BATCH) if val else None


def run_fit(trainer, module, steps: int, data_seed: int = 0, ckpt_path=None, val: bool = False) -> None:
    """``trainer.fit`` on :func:`loaders`, without the warnings about tiny data loaders."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|bottleneck|does not have many workers).*")
        trainer.fit(module, *loaders(steps, data_seed, val), ckpt_path=ckpt_path)


def fit(pl, module, steps: int = 4, callbacks=(), precision=None, clip=None, algorithm=None,
        val_every: int | None = None, ckpt_path=None, root=None, epochs: int = 1, data_seed: int = 0,
        accelerator: str = ACCELERATOR, plugins=(), log_every_n_steps: int = 1):
    """Trainer.fit: ``epochs`` passes over ``steps`` fixed batches; returns the Trainer."""
    trainer = make_trainer(pl, callbacks, precision, clip, algorithm, val_every, root, epochs, accelerator,
                           plugins, log_every_n_steps)
    run_fit(trainer, module, steps, data_seed, ckpt_path, val=bool(val_every))
    return trainer


def float16_mixed(pl):
    """16-mixed with a GradScaler, also on CPU (``precision="16-mixed"`` falls back to bf16-mixed
    there; the plugin itself runs float16 autocast on CPU)."""
    device = "cuda" if ACCELERATOR == "gpu" else "cpu"
    return pl.plugins.MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device))


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items() if v.is_floating_point()}


def assert_params_equal(a, b, atol=0.0, rtol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
