"""GradBuckets: the flat grads cut into buckets whose all-reduces launch from hooks while the backward
runs; equal to FlatGrads.all_reduce after the backward (2 gloo processes on the CPU, eagerly; and 2
GPUs with NCCL, where a GraphedModule captures the bucketed backward and replays it)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._helpers import join_two_ranks, spawn_two_ranks
from trainfuse.clients import FlatGrads, GradBuckets


def _net(device="cpu") -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4),
                        nn.Linear(4, 4))
    net[-1].requires_grad_(False)
    return net.to(device)


def _index(flat: FlatGrads, param: torch.Tensor) -> int:
    return next(i for i, p in enumerate(flat.params) if p is param)


def _backward(net: nn.Module, x: torch.Tensor, buckets: GradBuckets | None, zero: bool,
              log: list | None = None) -> None:
    """``net``'s mean-square loss backward through ``autograd.grad`` (as a captured backward runs it),
    the grads handed to a bucket launch by hooks; without ``buckets``, added into the grads."""
    params = [p for p in net.parameters() if p.requires_grad]
    loss = net(x).square().mean()
    if buckets is None:
        grads = torch.autograd.grad(loss, params)
        torch._foreach_add_([p.grad for p in params], list(grads))
        return
    kept = [buckets.flat.grads[_index(buckets.flat, p)] for p in params]
    launch = buckets.start(params, kept, zero)
    assert launch is not None and launch.positions == frozenset(range(len(params)))

    def ready(i, g):
        if log is not None:
            log.append(("grad", i))
        launch.ready(i, g)

    hooks = [p.register_hook(functools.partial(ready, i)) for i, p in enumerate(params)]
    try:
        torch.autograd.grad(loss, params)
    finally:
        for h in hooks:
            h.remove()
    launch.finish()


def test_buckets_cover_each_buffer_in_reverse_order_within_the_cap():
    net = _net()
    net[0].half()  # a second buffer
    flat = FlatGrads(net.parameters()).attach()
    buckets = GradBuckets(flat, cap_bytes=32 * 32 * 4)  # the middle weight reaches it
    for key, buffer in flat.buffers.items():
        spans = [(start, stop, members) for k, (start, stop), members in buckets.buckets if k == key]
        assert spans[0][1] == buffer.numel() and spans[-1][0] == 0  # from the end of the buffer back
        for (start, _, _), (_, stop, _) in zip(spans, spans[1:]):
            assert stop == start  # contiguous, no gap, no overlap
        for start, stop, members in spans:
            assert sum(flat.params[i].numel() for i in members) == stop - start
            size = buffer.element_size() * sum(flat.params[i].numel() for i in members[:-1])
            assert size < 32 * 32 * 4  # closed as soon as the cap is reached
    assert sorted(buckets.bucket_of) == list(range(len(flat.params)))
    weight = _index(flat, net[2].weight)
    assert buckets.buckets[buckets.bucket_of[weight]][2][-1] == weight  # it reaches the cap: closed
    assert [m for _, _, m in GradBuckets(flat, cap_bytes=1).buckets] == [[i] for i in (1, 0, 5, 4, 3, 2)]
    with pytest.raises(ValueError, match="cap_bytes must be > 0"):
        GradBuckets(flat, cap_bytes=0)


def test_a_backward_that_misses_a_param_or_a_view_gets_no_launch():
    net = _net()
    flat = FlatGrads(net.parameters()).attach()
    buckets = GradBuckets(flat)
    params = flat.params
    assert buckets.start(params[1:], flat.grads[1:], False) is None  # another backward adds to params[0]
    other = [g.clone() for g in flat.grads]
    assert buckets.start(params, other, False) is None  # the grads would not land in the buffer
    extra = nn.Parameter(torch.zeros(3))
    launch = buckets.start([extra, *params], [torch.zeros(3), *flat.grads], False)
    assert launch is not None and launch.positions == frozenset(range(1, len(params) + 1))


@pytest.mark.parametrize("zero", [False, True])
def test_without_a_process_group_the_launch_adds_or_writes_the_grads(zero):
    x = torch.randn(5, 6)
    ref, net = _net(), _net()
    ref(x).square().mean().backward()
    ref(x).square().mean().backward()
    flat = FlatGrads(net.parameters()).attach()
    buckets = GradBuckets(flat, cap_bytes=512)
    net(x).square().mean().backward()
    if zero:
        flat.buffers[next(iter(flat.buffers))].fill_(7.0)  # written over, not added to
    _backward(net, x, buckets, zero=zero)
    for p, q in zip(net.parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad / 2 if zero else q.grad)


def _ranks(rank: int, root: str, backend: str) -> None:
    device = join_two_ranks(rank, root, backend)
    try:
        if backend == "nccl":  # the captured backward, as the Lightning client runs it
            torch.manual_seed(100 + rank)
            xs = [torch.randn(5, 6, device=device) for _ in range(3)]
            torch.save({"graphed": _graphed_ranks(device, xs)}, os.path.join(root, f"rank{rank}.pt"))
            return
        torch.manual_seed(100 + rank)
        xs = [torch.randn(5, 6, device=device) for _ in range(3)]
        ref = _net(device)
        ref_flat = FlatGrads(ref.parameters()).attach()
        for x in xs:
            ref(x).square().mean().backward()
        ref_flat.all_reduce(average=True)
        net = _net(device)
        flat = FlatGrads(net.parameters()).attach()
        buckets = GradBuckets(flat, cap_bytes=512)
        assert len(buckets.buckets) >= 3
        log: list = []
        original = buckets.reduce
        buckets.reduce = lambda b: (log.append(("reduce", b)), original(b))[1]
        for i, x in enumerate(xs):  # the last micro-batch reduces, overlapping its backward
            _backward(net, x, buckets if i == len(xs) - 1 else None, zero=False, log=log)
        reduces = [i for i, (what, _) in enumerate(log) if what == "reduce"]
        grads = [i for i, (what, _) in enumerate(log) if what == "grad"]
        assert len(reduces) == len(buckets.buckets) and reduces[0] < grads[-1]  # launched mid-backward
        out = {"ref": [p.grad.cpu() for p in ref.parameters() if p.requires_grad],
               "ours": [p.grad.cpu() for p in net.parameters() if p.requires_grad]}
        torch.save(out, os.path.join(root, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


class _Sync:
    """A data-parallel caller's gradient sync for a GraphedModule: every call reduces."""

    def __init__(self, buckets: GradBuckets):
        self.buckets, self.replays = buckets, 0

    def active(self) -> bool:
        return True

    def start(self, leaves, kept, zero):
        return self.buckets.start(leaves, kept, zero)

    def replayed(self) -> None:
        self.replays += 1


def _graphed_ranks(device: torch.device, xs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per step, the grads of a GraphedModule whose captured backward holds the bucketed all-reduce,
    and those of eager steps reduced after the backward; first step eager, then captured, replayed."""
    from trainfuse.graphs import GraphedModule

    net, ref = _net(device), _net(device)
    flat, ref_flat = FlatGrads(net.parameters()).attach(), FlatGrads(ref.parameters()).attach()
    views = dict(zip(map(id, flat.params), flat.grads))
    sync = _Sync(GradBuckets(flat, cap_bytes=512))
    graphed = GraphedModule.install(net, grads=lambda p: views.get(id(p)), sync=sync)
    steps = []
    for step in range(4):
        x = xs[step % len(xs)]
        net.zero_grad(set_to_none=step % 2 == 0)  # both backward graphs: writing, adding to zeros
        ref.zero_grad(set_to_none=False)
        replays = sync.replays
        net(x).square().mean().backward()
        if sync.replays == replays:  # eager: reduced after the backward
            flat.attach()
            flat.all_reduce(average=True)
        ref(x).square().mean().backward()
        ref_flat.all_reduce(average=True)
        steps.append([torch.stack([p.grad.flatten().sum() for p in m.parameters() if p.requires_grad]).cpu()
                      for m in (net, ref)] + [torch.tensor(sync.replays)])
    assert graphed.stats.replays >= 2
    graphed.uninstall()  # its graphs hold NCCL work: freed before the process group is destroyed
    torch.cuda.synchronize()
    return steps


@pytest.mark.parametrize("backend", ["torch", "nccl"])
def test_bucketed_all_reduce_equals_the_one_after_the_backward_on_two_ranks(backend, tmp_path, monkeypatch):
    spawn_two_ranks(_ranks, str(tmp_path), backend, monkeypatch)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    if backend != "nccl":  # eager, the hooks launching gloo all-reduces mid-backward
        for r in ranks:
            for ours, ref in zip(r["ours"], r["ref"]):
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
        for a, b in zip(ranks[0]["ours"], ranks[1]["ours"]):
            assert torch.equal(a, b)
    else:
        steps = ranks[0]["graphed"]
        assert steps[-1][2].item() >= 2  # the bucketed backward was replayed
        for ours, ref, _ in steps:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(ranks[0]["graphed"], ranks[1]["graphed"]))
