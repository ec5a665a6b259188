"""A LightningModule that pairs FusedMuon (its matrices) with AdamW (the rest), as Muon's users do,
trains in a real Trainer.fit under FusedTraining exactly as with torch.optim.Muon (CPU: the torch
path, Muon's own ops)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.lightning.helpers import package
from trainfuse.lightning import FusedTraining
from trainfuse.optim.muon import FusedMuon

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch 2.9+")


def _fit(pl, muon_cls):
    class TwoOptimizers(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 16, bias=False), nn.GELU(), nn.Linear(16, 16, bias=False))
            self.head = nn.Linear(16, 2)
            self.automatic_optimization = False  # two optimizers, stepped by the module
            self.losses = []

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(loss.detach())
            opts = self.optimizers()
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in opts:
                opt.step()

        def configure_optimizers(self):
            return [muon_cls(self.body.parameters(), lr=0.02),
                    torch.optim.AdamW(self.head.parameters(), lr=1e-3)]

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randint(0, 2, (32,), generator=g))
    module, cb = TwoOptimizers(), FusedTraining(verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|bottleneck|does not have many workers).*")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return module


def test_fused_muon_with_adamw_trains_like_torch_muon(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    pl = package()
    ours, ref = _fit(pl, FusedMuon), _fit(pl, torch.optim.Muon)
    assert torch.equal(torch.stack(ours.losses), torch.stack(ref.losses))
    for (name, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name
