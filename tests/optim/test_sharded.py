"""Clipping over sharded grads in a 2-process gloo group (CPU): each rank holds some of the
tensors, as FSDP's shards, and the clipping norm must be that of all of them. Compared against one
process clipping every tensor with torch (``clip_grad_norm_``, then torch.optim.AdamW).

The kernel variant runs the Triton interpreter in both processes; it needs no GPU. The ``nccl``
variant runs the compiled kernels on 2 GPUs (skipped with fewer)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import trainfuse
from tests._helpers import join_two_ranks, spawn_two_ranks
from trainfuse.amp import clip_grad_norm_

SHAPES = [(7, 5), (33,), (4, 4, 3), (1,), (64,), (3, 17)]
MAX_NORM = 0.5
STEPS = 3


def _tensors(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def _mine(items: list, rank: int) -> list:
    return items[rank::2]  # rank 0 holds tensors 0, 2, 4; rank 1 holds 1, 3, 5


def _worker(rank: int, root: str, backend: str = "gloo") -> None:
    device = join_two_ranks(rank, root, backend)  # results are saved on the CPU
    try:
        out = {}
        group = dist.group.WORLD
        for norm_type in (2.0, float("inf")):
            params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in _mine(SHAPES, rank)]
            for p, g in zip(params, _mine(_tensors(1, 3.0), rank)):
                p.grad = g.to(device)
            total = clip_grad_norm_(params, MAX_NORM, norm_type, process_group=group)
            out[f"clip{norm_type}"] = (total.cpu().clone(), [p.grad.cpu().clone() for p in params])
        params = [torch.nn.Parameter(w.to(device)) for w in _mine(_tensors(2), rank)]
        opt = trainfuse.FusedAdamW(params, lr=0.05, weight_decay=0.1, max_grad_norm=MAX_NORM)
        opt.shard_group = group
        norms = []
        for step in range(STEPS):
            for p, g in zip(params, _mine(_tensors(10 + step, 0.3 + step), rank)):
                p.grad = g.to(device)
            opt.step()
            norms.append(opt.grad_norm.cpu().clone())
        out["adamw"] = ([p.detach().cpu().clone() for p in params], norms)
        torch.save(out, os.path.join(root, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference() -> dict:
    out = {}
    for norm_type in (2.0, float("inf")):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        for p, g in zip(params, _tensors(1, 3.0)):
            p.grad = g.clone()
        total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type)
        out[f"clip{norm_type}"] = (total, [p.grad for p in params])
    params = [torch.nn.Parameter(w) for w in _tensors(2)]
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        for p, g in zip(params, _tensors(10 + step, 0.3 + step)):
            p.grad = g.clone()
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
        opt.step()
    out["adamw"] = ([p.detach() for p in params], norms)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton", "nccl"])
def test_two_ranks_clip_like_one_process_over_all_tensors(backend, tmp_path, monkeypatch):
    spawn_two_ranks(_worker, str(tmp_path), backend, monkeypatch)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = _reference()
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for key in ("clip2.0", "clipinf"):
        total, grads = ref[key]
        for rank, got in enumerate(ranks):
            torch.testing.assert_close(got[key][0], total, **tol)  # every rank sees the global norm
            for g, want in zip(got[key][1], _mine(grads, rank)):
                torch.testing.assert_close(g, want, **tol)
    weights, norms = ref["adamw"]
    assert float(norms[0]) > MAX_NORM  # the clip bites
    for rank, got in enumerate(ranks):
        mine, got_norms = got["adamw"]
        for w, want in zip(mine, _mine(weights, rank)):
            torch.testing.assert_close(w, want, **tol)
        torch.testing.assert_close(torch.stack(got_norms), torch.stack(norms), **tol)


def test_shard_group_must_be_a_process_group():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    opt = trainfuse.FusedAdamW([p], max_grad_norm=1.0)
    opt.shard_group = "world"
    before = p.detach().clone()
    with pytest.raises((RuntimeError, TypeError), match="shard_group"):
        opt.step()
    assert torch.equal(p.detach(), before)
