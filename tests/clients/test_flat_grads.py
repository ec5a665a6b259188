"""FlatGrads: every grad a view of one buffer per dtype with its param's layout, accumulated in place
by the backward, and one all-reduce equal to DDP's (2 processes with gloo on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainfuse.clients import FlatGrads


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 5, 1), nn.Flatten(),
                        nn.LazyLinear(3))
    net(torch.randn(1, 3, 6, 6))  # the lazy layer takes its shape
    return net


def test_views_share_one_buffer_per_dtype_with_the_params_layout():
    net = _net().to(memory_format=torch.channels_last)
    net[-1].half()
    flat = FlatGrads(net.parameters()).attach()
    assert {k[1] for k in flat.buffers} == {torch.float32, torch.float16}
    sizes = {dt: sum(p.numel() for p in net.parameters() if p.dtype == dt)
             for dt in (torch.float32, torch.float16)}
    assert {k[1]: b.numel() for k, b in flat.buffers.items()} == sizes
    for p in net.parameters():
        assert p.grad.stride() == p.stride() and p.grad.dtype == p.dtype  # channels_last kept
        buffer = flat.buffers[(p.device, p.dtype)]
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert not p.grad.any()
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_backward_accumulates_into_the_views_and_a_none_grad_is_reported():
    net = _net()
    x = torch.randn(4, 3, 6, 6)
    ref = _net()
    ref(x).square().sum().backward()
    ref(x).square().sum().backward()
    flat = FlatGrads(net.parameters()).attach()
    for _ in range(2):
        net(x).square().sum().backward()
    assert flat.attached()
    offset = 0
    buffer = next(iter(flat.buffers.values()))
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(buffer[offset:offset + p.numel()], q.grad.reshape(-1))
        offset += p.numel()
    net.zero_grad(set_to_none=True)
    assert not flat.attached()
    flat.attach()
    assert flat.attached() and not buffer.any()


def test_frozen_and_shared_params_are_left_out_or_counted_once():
    a = nn.Linear(4, 4)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    flat = FlatGrads([a.weight, a.bias, a.weight, frozen.weight]).attach()
    assert flat.params == [a.weight, a.bias]
    assert next(iter(flat.buffers.values())).numel() == 20 and frozen.weight.grad is None
    flat.detach()
    assert a.weight.grad is None and a.bias.grad is None


def test_all_reduce_outside_a_process_group_changes_nothing():
    net = _net()
    flat = FlatGrads(net.parameters()).attach()
    net(torch.randn(2, 3, 6, 6)).sum().backward()
    before = [p.grad.clone() for p in net.parameters()]
    flat.all_reduce(average=True)
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(100 + rank)
        xs = [torch.randn(4, 3, 6, 6) for _ in range(2)]  # two micro-batches per rank
        # DDP: an all-reduce (average) per backward, as ultralytics runs it (no no_sync)
        ddp = nn.parallel.DistributedDataParallel(_net())
        for x in xs:
            ddp(x).square().mean().backward()
        # ours: the micro-batches accumulate in place, then one all-reduce
        net = _net()
        flat = FlatGrads(net.parameters()).attach()
        for x in xs:
            net(x).square().mean().backward()
        flat.all_reduce(average=True)
        summed = _net()
        sum_flat = FlatGrads(summed.parameters()).attach()
        for x in xs:  # without ultralytics' world-size factor, a plain sum is DDP's average
            summed(x).square().mean().backward()
        sum_flat.all_reduce(average=False)
        if not flat.attached():
            raise AssertionError("the grads left the buffer")
        grads = {"ddp": ddp.module, "flat": net, "sum": summed}
        torch.save({k: [p.grad for p in m.parameters()] for k, m in grads.items()},
                   os.path.join(out, f"rank{rank}.pt"))
        net.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match="no longer views"):
            flat.all_reduce()
    finally:
        dist.destroy_process_group()


def test_one_all_reduce_after_accumulating_equals_ddp_on_two_processes(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_rank, args=(2, init, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        for ddp, flat, summed in zip(r["ddp"], r["flat"], r["sum"]):
            torch.testing.assert_close(flat, ddp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(summed, ddp * 2, rtol=1e-5, atol=1e-6)  # = DDP's of loss * 2
    for a, b in zip(ranks[0]["flat"], ranks[1]["flat"]):
        assert torch.equal(a, b)  # every rank holds the same reduced grads
