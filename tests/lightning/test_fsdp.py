"""FusedTraining under Lightning's sharded strategies: ModelParallelStrategy with ``fully_shard``
(FSDP2; 2 processes with gloo on the CPU, NCCL on 2 GPUs) and FSDPStrategy with
``use_orig_params=True`` (FSDP; Lightning runs it on GPUs only).

Each fit runs ``tests/lightning/fsdp_fit.py`` in a subprocess (these strategies start their other
ranks by running the command again). Every run trains on the same global batch, so the sharded
runs must end where one process does, with the same pre-clip norms: the fused optimizer steps each
rank's shards and clips by the norm of all of them. A distributed checkpoint written by 2 ranks
resumes on 2 ranks and on 1, and ends where the uninterrupted run does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

SCRIPT = Path(__file__).with_name("fsdp_fit.py")


def _fit(out: Path, strategy: str, devices: int, accelerator: str, epochs: int = 2, ckpt: Path | None = None):
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off
    for key in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED"):
        env.pop(key, None)  # a fresh rendezvous: Lightning picks a free port for this fit
    cmd = [sys.executable, str(SCRIPT), str(out), strategy, str(devices), accelerator, str(epochs)]
    if ckpt is not None:
        cmd.append(str(ckpt))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def _load(out: Path, name: str) -> dict:
    return torch.load(out / name, map_location="cpu")


def _same_weights(a: dict, b: dict, exact: bool = False) -> None:
    assert a["params"].keys() == b["params"].keys()
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for k, v in a["params"].items():
        torch.testing.assert_close(b["params"][k], v, **tol, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(b["norms"]), torch.tensor(a["norms"]), **tol)


@pytest.mark.parametrize("strategy,accelerator", [
    pytest.param("fsdp2", "cpu", marks=pytest.mark.cpu_training), ("fsdp2", "gpu"), ("fsdp", "gpu")])
def test_sharded_ranks_match_one_process_and_resume_from_their_checkpoint(strategy, accelerator, tmp_path):
    if accelerator == "gpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _fit(tmp_path, "single", 1, accelerator)
    _fit(tmp_path, strategy, 2, accelerator)
    one = _load(tmp_path, "single-rank0.pt")
    ranks = [_load(tmp_path, f"{strategy}-rank{r}.pt") for r in range(2)]
    assert one["optimizer"] == "FusedAdamW" and one["report"]["ema"] == "on"
    for got in ranks:
        report = got["report"]
        assert got["optimizer"] == "FusedAdamW" and report["optimizer"] == "swapped"
        assert report["strategy"] == "on" and report["clipping"] == "on"
        assert report["ema"] == "skipped" and report["graphs"] == "off" and report["casts"] == "off"
        assert max(got["norms"]) > 0.3  # the clip bites
        assert got["norms"] == ranks[0]["norms"]  # every rank clips with the same (global) norm
    _same_weights(one, ranks[0])  # FSDP gathers the full weights on rank zero
    if strategy == "fsdp2":
        _same_weights(one, ranks[1])
        ckpt = tmp_path / "fsdp2-ckpt" / "epoch=0.ckpt"
        assert ckpt.is_dir()  # a distributed (sharded) checkpoint
        for devices in (2, 1):
            out = tmp_path / f"resume-on-{devices}"
            out.mkdir()
            _fit(out, "fsdp2", devices, accelerator, ckpt=ckpt)
            resumed = _load(out, "resumed-fsdp2-rank0.pt")
            assert len(resumed["norms"]) == len(ranks[0]["norms"]) // 2  # the second epoch only
            tail = {"params": ranks[0]["params"], "norms": ranks[0]["norms"][len(resumed["norms"]):]}
            _same_weights(tail, resumed, exact=devices == 2)
