"""FusedTraining under Lightning's DDP: 2 processes on the CPU with the gloo backend (the fused
optimizers take torch's path there) against 1 process with the same global batch; the same on
2 GPUs with NCCL and the compiled kernels where there are 2.

A DistributedSampler without shuffling (Lightning's own shuffles) gives rank r the samples r, r + 2,
...: with a per-rank batch
of B, step k of the two ranks covers exactly the 2B samples of step k of one process with batch 2B,
and DDP's averaged grads are that batch's mean-loss grads. The model has no BatchNorm (its
statistics would be per rank)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from trainfuse.lightning import FusedTraining  # noqa: E402

IN, HIDDEN, OUT, BATCH, STEPS = 8, 16, 4, 4, 6


@pytest.fixture(autouse=True)
def _own_port(monkeypatch):
    """Each test's process groups rendezvous on a port picked free for that test: Lightning leaves
    the MASTER_PORT it picks in os.environ, and under pytest-xdist the OS may later hand that port
    to another worker's process group."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    yield
    os.environ.pop("MASTER_PORT", None)


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * STEPS * BATCH, IN, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :OUT] > 0).float())


class Net(pl.LightningModule):
    """An MLP with a BCE loss; each rank writes its live params (at its last epoch's end) and the
    EMA FusedTraining leaves in the module when training ends."""

    def __init__(self, out_dir: str, tag: str = ""):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.head = nn.Linear(HIDDEN, OUT)
        self.crit = nn.BCEWithLogitsLoss()
        self.out_dir, self.tag = out_dir, tag

    def training_step(self, batch, i):
        x, y = batch
        return self.crit(self.head(self.body(x)), y)

    def train_dataloader(self):
        # in order on every rank (Lightning's own DistributedSampler shuffles training data)
        data = _data()
        sampler = torch.utils.data.DistributedSampler(data, self.trainer.world_size, self.global_rank,
                                                      shuffle=False)
        batch = BATCH * 2 // self.trainer.world_size
        return torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def on_train_epoch_end(self):
        self.live = {k: v.detach().clone() for k, v in self.named_parameters()}

    def on_train_end(self):
        fused = [c for c in self.trainer.callbacks if isinstance(c, FusedTraining)]
        state = {"params": self.live,
                 "ema": {k: v.detach().clone() for k, v in self.named_parameters()} if fused else None,
                 "report": [(r.kind, r.action) for r in fused[0].report] if fused else None,
                 "details": {r.kind: r.detail for r in fused[0].report} if fused else None,
                 "replays": sum(s.replays for s in fused[0].graph_stats.values()) if fused else None,
                 "overlapped": fused[0].overlapped_steps if fused else None}
        name = f"{self.tag}rank{self.global_rank}-of-{self.trainer.world_size}.pt"
        torch.save(state, os.path.join(self.out_dir, name))


class WholeNet(Net):
    """The same model with a ``forward`` that runs all of it: one graphed forward reaches every param."""

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, i):
        x, y = batch
        return self.crit(self(x), y)


def _fit(out_dir, devices: int, epochs: int = 1, tag: str = "", ckpt_dir=None, ckpt_path=None,
         accelerator: str = "cpu", graphs: bool = False, accumulate: int = 1,
         precision: str = "32-true", model: type[Net] = Net) -> None:
    saver = ([pl.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), every_n_epochs=1, save_top_k=-1,
                                           filename="{epoch}")] if ckpt_dir else [])
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, precision=precision,
                         strategy="ddp_spawn" if devices > 1 else "auto",
                         max_epochs=epochs, logger=False, enable_checkpointing=bool(saver),
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.3,
                         use_distributed_sampler=False, accumulate_grad_batches=accumulate,
                         callbacks=[FusedTraining(ema_decay=0.8, verbose=False, cuda_graphs=graphs), *saver])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|bottleneck|does not have many workers).*")
        trainer.fit(model(str(out_dir), tag), ckpt_path=None if ckpt_path is None else str(ckpt_path))


def _load(path) -> dict:
    """A rank's saved state, on the CPU (rank 1 of a GPU run saved its tensors on cuda:1)."""
    return torch.load(path, map_location="cpu")


def _close(a: dict, b: dict) -> None:
    """Params and the EMA of two runs within float32 tolerance (all-reduce orders differ)."""
    for key in ("params", "ema"):
        for k, v in a[key].items():
            if torch.is_tensor(v):
                torch.testing.assert_close(b[key][k], v, rtol=1e-5, atol=1e-6, msg=f"{key} {k}")


@pytest.mark.parametrize("accelerator,graphs", [pytest.param("cpu", False, marks=pytest.mark.cpu_training),
                                               ("gpu", False), ("gpu", True)])
def test_two_ddp_ranks_match_one_process_with_the_same_global_batch(accelerator, graphs, tmp_path,
                                                                    monkeypatch):
    """DDP's reducer off, one flat all-reduce per step instead; with CUDA graphs (3 epochs: 2 eager
    steps per shape, then replays) the replays accumulate into the flat buffer."""
    if accelerator == "gpu":  # NCCL and the compiled kernels
        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    epochs = 3 if graphs else 1
    _fit(tmp_path, 1, epochs=epochs, accelerator=accelerator, graphs=graphs)
    _fit(tmp_path, 2, epochs=epochs, accelerator=accelerator, graphs=graphs)
    one = _load(tmp_path / "rank0-of-1.pt")
    ranks = [_load(tmp_path / f"rank{r}-of-2.pt") for r in range(2)]
    report = dict(ranks[0]["report"])
    assert report["optimizer"] == "swapped"
    assert report["clipping"] == "on"
    assert report["ddp"] == "on" and "ddp" not in dict(one["report"])
    assert report["graphs"] == ("on" if graphs else "off")
    if graphs:
        assert ranks[0]["replays"] >= 10, ranks[0]["replays"]
    for k, v in one["params"].items():
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k  # every rank the same
        torch.testing.assert_close(ranks[0]["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    ema_one = one["ema"]
    for r in ranks:
        for k, v in r["ema"].items():
            if torch.is_tensor(v):
                torch.testing.assert_close(v, ema_one[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_graphed_backward_all_reduces_inside_the_replay_and_matches_one_process(accumulate, tmp_path,
                                                                                 monkeypatch):
    """A forward that reaches every param: the last micro-batch's replayed backward averages the
    grads in buckets overlapping it, and the ranks end where one process does."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    for devices in (1, 2):
        _fit(tmp_path, devices, epochs=3, accelerator="gpu", graphs=True, accumulate=accumulate,
             model=WholeNet)
    one = _load(tmp_path / "rank0-of-1.pt")
    ranks = [_load(tmp_path / f"rank{r}-of-2.pt") for r in range(2)]
    assert "buckets overlapping it" in ranks[0]["details"]["graphs"]
    assert ranks[0]["overlapped"] >= 3 * STEPS // accumulate - 4, ranks[0]["overlapped"]  # all but eager ones
    assert ranks[0]["overlapped"] == ranks[1]["overlapped"]
    for k in one["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k
    _close(one, ranks[0])


def test_accumulation_all_reduces_once_per_step_and_matches_one_process(tmp_path):
    """accumulate_grad_batches=3: Lightning's no_sync on the first micro-batches leaves DDP's reducer
    off (the value the change set), the one all-reduce runs before the step, and the ranks end
    where one process with the same global batch does."""
    _fit(tmp_path, 1, tag="acc-", accumulate=3)
    _fit(tmp_path, 2, tag="acc-", accumulate=3)
    one = _load(tmp_path / "acc-rank0-of-1.pt")
    ranks = [_load(tmp_path / f"acc-rank{r}-of-2.pt") for r in range(2)]
    assert dict(ranks[0]["report"])["ddp"] == "on"
    for k in one["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k
    _close(one, ranks[0])


def test_checkpoints_from_either_layout_resume_on_the_other(tmp_path):
    """Rank zero writes the checkpoint of a 2-process run; one process resumes it, and a 2-process
    run resumes a 1-process checkpoint: both end where the uninterrupted runs of 2 epochs do."""
    for devices in (1, 2):
        _fit(tmp_path, devices, epochs=2, tag=f"full{devices}-", ckpt_dir=tmp_path / f"ckpt{devices}")
    for saved, resumed in ((2, 1), (1, 2)):
        ckpt = tmp_path / f"ckpt{saved}" / "epoch=0.ckpt"
        _fit(tmp_path, resumed, epochs=2, tag=f"from{saved}-", ckpt_path=ckpt)
    full = {d: _load(tmp_path / f"full{d}-rank0-of-{d}.pt") for d in (1, 2)}
    _close(full[1], full[2])
    _close(full[1], _load(tmp_path / "from2-rank0-of-1.pt"))
    for r in range(2):
        _close(full[2], _load(tmp_path / f"from1-rank{r}-of-2.pt"))


@pytest.mark.parametrize("accelerator", [pytest.param("cpu", marks=pytest.mark.cpu_training), "gpu"])
def test_bf16_casts_stay_on_under_ddp_and_all_reduce_16_bit_grads(accelerator, tmp_path, monkeypatch):
    """bf16-mixed: with DDP's reducer replaced by the flat all-reduce, the casts apply as on one
    device (16-bit weights, float32 masters in the optimizer); the cast params' buffer is bf16,
    so the 2 ranks average bf16 grads. They stay equal bit for bit and end near one process: AdamW
    turns the bf16 roundings of small grads into whole steps of the learning rate (1e-2) here and
    there, so the bound is on the mean and on one step's worth per element."""
    if accelerator == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the casts need the kernels: on CPU tensors, through the interpreter only")
    if accelerator == "gpu":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")  # the casts need the kernels (interpreter on CPU)
    _fit(tmp_path, 1, tag="bf16-", precision="bf16-mixed", accelerator=accelerator)
    _fit(tmp_path, 2, tag="bf16-", precision="bf16-mixed", accelerator=accelerator)
    one = _load(tmp_path / "bf16-rank0-of-1.pt")
    ranks = [_load(tmp_path / f"bf16-rank{r}-of-2.pt") for r in range(2)]
    for got in (one, *ranks):
        assert dict(got["report"])["casts"] == "on"
    assert dict(ranks[0]["report"])["ddp"] == "on" and "bfloat16" in ranks[0]["details"]["ddp"]
    assert {v.dtype for k, v in ranks[0]["params"].items() if k.endswith("weight")} == {torch.bfloat16}
    for k, v in one["params"].items():
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k
        diff = (ranks[0]["params"][k].float() - v.float()).abs()
        assert float(diff.mean()) < 1e-3 and float(diff.max()) < 1.5e-2, (k, diff.mean(), diff.max())
