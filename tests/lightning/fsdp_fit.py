"""One Lightning fit under FusedTraining, run as a script: Lightning's FSDPStrategy and
ModelParallelStrategy start their other ranks by running the same command again, so
``tests/lightning/test_fsdp.py`` runs this file in a subprocess.

    python tests/lightning/fsdp_fit.py OUT STRATEGY DEVICES ACCELERATOR EPOCHS [CKPT]

STRATEGY: ``single`` (one process, the reference), ``fsdp`` (FSDPStrategy, use_orig_params=True)
or ``fsdp2`` (ModelParallelStrategy, ``fully_shard`` per layer in ``configure_model``). Every run
sees the same global batch of 2 * BATCH a step (rank r takes samples r, r + 2, ...), so all three
end on the same weights. Rank r writes ``OUT/STRATEGY-rank{r}.pt``: the full params at the end,
the fused report, and the pre-clip norms. A ModelCheckpoint writes ``OUT/STRATEGY-ckpt/`` every
epoch; CKPT resumes from one.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from trainfuse.lightning import FusedTraining

IN, HIDDEN, OUT, BATCH, STEPS_PER_EPOCH = 6, 10, 3, 4, 3


class Net(pl.LightningModule):
    def __init__(self, out_dir: str, strategy: str, tag: str):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, OUT)
        self.out_dir, self.strategy, self.tag = out_dir, strategy, tag
        self.norms: list[float] = []

    def configure_model(self):
        if self.strategy != "fsdp2":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.body[0], self.body[2], self.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, i):
        x, y = batch
        return (self.head(self.body(x)) - y).square().mean()

    def on_train_batch_end(self, outputs, batch, i):
        norm = getattr(self.trainer.optimizers[0], "grad_norm", None)
        self.norms.append(float(norm) if norm is not None else float("nan"))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = 2 * BATCH * STEPS_PER_EPOCH
        x = torch.randn(n, IN, generator=g)
        data = torch.utils.data.TensorDataset(x, torch.randn(n, OUT, generator=g) + x[:, :OUT])
        world, rank = self.trainer.world_size, self.global_rank
        sampler = torch.utils.data.DistributedSampler(data, world, rank, shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=2 * BATCH // world, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)

    def on_train_epoch_end(self):  # the live weights (the EMA, where one runs, goes in after the fit)
        if self.strategy == "fsdp":  # FSDP's full state dict, gathered on rank zero (every rank joins)
            params = self.trainer.strategy.lightning_module_state_dict()
        else:
            params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                      for k, v in self.state_dict().items()}
        self.live = {k: v.detach().cpu().clone() for k, v in params.items()}

    def on_train_end(self):
        fused = next(c for c in self.trainer.callbacks if isinstance(c, FusedTraining))
        out = {"params": self.live,
               "report": {r.kind: r.action for r in fused.report}, "reasons": [str(r) for r in fused.report],
               "norms": self.norms, "optimizer": type(self.trainer.optimizers[0]).__name__}
        torch.save(out, os.path.join(self.out_dir, f"{self.tag}{self.strategy}-rank{self.global_rank}.pt"))


def main(out_dir: str, strategy: str, devices: int, accelerator: str, epochs: int, ckpt: str | None) -> None:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    chosen = {"single": "auto", "fsdp": FSDPStrategy(use_orig_params=True),
              "fsdp2": ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)}[strategy]
    tag = "resumed-" if ckpt else ""
    saver = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out_dir, f"{strategy}-ckpt"), every_n_epochs=1,
                                         save_top_k=-1, filename="{epoch}")
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=chosen, max_epochs=epochs,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=0.3, use_distributed_sampler=False,
                         callbacks=[FusedTraining(ema_decay=0.9, verbose=False), saver])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|bottleneck|does not have many workers).*")
        trainer.fit(Net(out_dir, strategy, tag), ckpt_path=ckpt)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], int(args[2]), args[3], int(args[4]), args[5] if len(args) > 5 else None)
