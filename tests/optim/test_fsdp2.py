"""The fused optimizers on FSDP2 (``fully_shard``: DTensor params, each rank holding a shard), in a
2-process group: gloo on the CPU (torch's path, and the kernels through the interpreter), NCCL on
2 GPUs (the compiled kernels; skipped with fewer).

Each rank trains on half of the global batch; FSDP2's reduce-scatter averages the grads, so the
run must match one process training the whole model on the whole batch with torch.optim.AdamW and
``torch.nn.utils.clip_grad_norm_`` (the clipping norm is every rank's, not the local shard's). The
model's shapes shard unevenly, and a bias of one element leaves rank 1 with an empty shard.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import trainfuse
from tests._helpers import join_two_ranks, spawn_two_ranks
from trainfuse.optim import FusedEMA

fsdp = pytest.importorskip("torch.distributed.fsdp")

BATCH, STEPS, MAX_NORM, LR, DECAY = 6, 4, 0.05, 0.02, 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * BATCH, 5, generator=g), torch.randn(2 * BATCH, 1, generator=g)


def _loss(model, x, y) -> torch.Tensor:
    return (model(x) - y).square().mean()


def _sharded(device) -> nn.Module:
    # the mesh named: fully_shard's default is a CUDA mesh wherever CUDA is, gloo ranks included
    mesh = dist.device_mesh.init_device_mesh(device.type, (2,))
    model = _model().to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, rank: int, steps: range, device) -> list[torch.Tensor]:
    norms = []
    for step in steps:
        x, y = _batch(step)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        _loss(model, x[mine].to(device), y[mine].to(device)).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.grad_norm.detach().cpu().clone())
    return norms


def _full(tensors: dict) -> dict:
    return {k: v.full_tensor().detach().cpu().clone() for k, v in tensors.items()}


def _worker(rank: int, root: str, backend: str) -> None:
    device = join_two_ranks(rank, root, backend)  # results are saved on the CPU
    try:
        out = {}
        model = _sharded(device)
        ema = FusedEMA(model, decay=DECAY, tau=1e-9)  # a constant decay
        opt = trainfuse.FusedAdamW(model.parameters(), lr=LR, weight_decay=0.1, max_grad_norm=MAX_NORM)
        opt.attach_ema(ema)
        weight = model[0].weight
        out["local_shapes"] = [tuple(p.to_local().shape) for p in model.parameters()]
        out["norms"] = _train(model, opt, rank, range(STEPS), device)
        out["state_is_sharded"] = type(opt.state[weight]["exp_avg"]).__name__
        out["params"] = _full(dict(model.named_parameters()))
        out["ema"] = _full(dict(ema.ema.named_parameters()))
        out["plan"] = opt.engine.plans.get(device) is not None
        # GradScaler's fused step_and_update updates the scale from this rank's inf flag alone:
        # refused for sharded params from the very first step (found_inf is combined first)
        fresh = trainfuse.FusedAdamW(model.parameters(), lr=LR)
        x, y = _batch(0)
        _loss(model, x[:BATCH].to(device), y[:BATCH].to(device)).backward()
        tracker = torch.zeros(1, dtype=torch.int32, device=device)
        out["scaled_first"] = fresh.scaled_step(torch.ones(1, device=device), (tracker, 2.0, 0.5, 2000))
        model.zero_grad()
        mesh = weight.device_mesh  # a replicated param beside sharded ones: a clear error
        odd = nn.Parameter(dist.tensor.distribute_tensor(torch.zeros(4, device=device), mesh,
                                                          [dist.tensor.Replicate()]))
        odd.grad = torch.zeros_like(odd)
        mixed = trainfuse.FusedAdamW([weight, odd], max_grad_norm=1.0)
        try:
            mixed.step()
        except ValueError as e:
            out["mixed_error"] = str(e)

        # torch's own AdamW on the same DTensor params (fused on CUDA, foreach on the CPU), clipped by
        # DTensor's clip_grad_norm_
        twin = _sharded(device)
        theirs = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=0.1, fused=device.type == "cuda")
        for step in range(STEPS):
            x, y = _batch(step)
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            _loss(twin, x[mine].to(device), y[mine].to(device)).backward()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
            theirs.step()
            theirs.zero_grad()
        out["torch_params"] = _full(dict(twin.named_parameters()))

        # a sharded state dict round trip: a new model and optimizer resume as the first goes on
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
        out["after"] = _train(model, opt, rank, range(STEPS, STEPS + 2), device)
        out["params_after"] = _full(dict(model.named_parameters()))
        resumed = _sharded(device)
        resumed.load_state_dict(saved["model"])
        opt2 = trainfuse.FusedAdamW(resumed.parameters(), lr=LR, weight_decay=0.1, max_grad_norm=MAX_NORM)
        opt2.load_state_dict(saved["opt"])
        out["resumed"] = _train(resumed, opt2, rank, range(STEPS, STEPS + 2), device)
        out["params_resumed"] = _full(dict(resumed.named_parameters()))
        torch.save(out, os.path.join(root, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference() -> dict:
    model = _model().double()
    ema = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    norms = []
    for step in range(STEPS + 2):
        x, y = _batch(step)
        _loss(model, x.double(), y.double()).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        if step < STEPS:
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 1 - DECAY)
        if step == STEPS - 1:
            params = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    return {"norms": torch.stack(norms).float(), "params": params,
            "params_after": {k: v.detach().float() for k, v in model.named_parameters()},
            "ema": {k: v.detach().float() for k, v in ema.named_parameters()}}


@pytest.mark.parametrize("backend", ["torch", "triton", "nccl"])
def test_fully_sharded_run_matches_one_process_on_the_whole_batch(backend, tmp_path, monkeypatch):
    spawn_two_ranks(_worker, str(tmp_path), backend, monkeypatch)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = _reference()
    tol = {"rtol": 2e-5, "atol": 2e-6}
    assert ranks[1]["local_shapes"][-1] == (0,)  # the last bias: rank 1 holds nothing of it
    assert float(ref["norms"][0]) > MAX_NORM  # the clip bites
    for got in ranks:
        assert "param 1 (shape (4,))" in got["mixed_error"] and "fully_shard" in got["mixed_error"]
        assert got["state_is_sharded"] == "DTensor"  # saved sharded, like the model
        assert got["scaled_first"] is False
        assert got["plan"] == (backend != "torch")  # the kernels ran on the local shards
        torch.testing.assert_close(torch.stack(got["norms"]), ref["norms"][:STEPS], **tol)
        for name in ("params", "ema", "params_after"):
            for k, want in ref[name].items():
                torch.testing.assert_close(got[name][k], want, **tol,
                                           msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
        for k, v in got["torch_params"].items():  # torch's AdamW on the same DTensors
            torch.testing.assert_close(got["params"][k], v, **tol, msg=lambda m, k=k: f"torch AdamW {k}: {m}")
        torch.testing.assert_close(torch.stack(got["resumed"]), torch.stack(got["after"]), rtol=0, atol=0)
        for k, v in got["params_after"].items():
            torch.testing.assert_close(got["params_resumed"][k], v, rtol=0, atol=0)



def _hsdp_worker(rank: int, root: str) -> None:
    """HSDP: 4 ranks, 2 replicas of a model sharded over 2 (``Replicate(), Shard(0)``)."""
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=4)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
        opt = trainfuse.FusedAdamW(model.parameters(), lr=LR, weight_decay=0.1, max_grad_norm=MAX_NORM)
        norms = []
        quarter = 2 * BATCH // 4
        for step in range(STEPS):
            x, y = _batch(step)
            mine = slice(rank * quarter, (rank + 1) * quarter)
            _loss(model, x[mine], y[mine]).backward()
            opt.step()
            opt.zero_grad()
            norms.append(opt.grad_norm.clone())
        group = opt.engine.plans.index.shard_group
        out = {"norms": norms, "params": _full(dict(model.named_parameters())),
               "group_size": dist.get_world_size(group), "placements": str(model[0].weight.placements)}
        torch.save(out, os.path.join(root, f"hsdp{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_hybrid_sharding_clips_by_the_norm_over_one_replica(tmp_path, monkeypatch):
    """HSDP's replicas hold the same averaged grads: the norm sums the shards of the shard
    dimension only (a sum over all 4 ranks would count every grad twice)."""
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    mp.spawn(_hsdp_worker, args=(str(tmp_path),), nprocs=4, join=True)
    ref = _reference()
    tol = {"rtol": 2e-5, "atol": 2e-6}
    for rank in range(4):
        got = torch.load(tmp_path / f"hsdp{rank}.pt")
        assert got["group_size"] == 2 and "Replicate" in got["placements"] and "Shard" in got["placements"]
        torch.testing.assert_close(torch.stack(got["norms"]), ref["norms"][:STEPS], **tol)
        for k, want in ref["params"].items():
            torch.testing.assert_close(got["params"][k], want, **tol)
