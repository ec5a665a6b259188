"""GraphedModule: a module's forward and backward replayed from CUDA graphs train exactly as eager.

Off CUDA the host logic runs: argument structures, the leaves a backward reaches, installing and
uninstalling, deep copies, and calls that pass through. The GPU tests train a graphed copy of a
model against an eager copy on the same batches in the same order and compare every loss, grad,
weight and BatchNorm statistic.
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._helpers import cuda
from trainfuse.graphs import GraphedModule, GraphPool, StepStats
from trainfuse.graphs.tree import flatten, reached_leaves, unflatten

Pair = namedtuple("Pair", "a b")


class Head(nn.Module):
    """A Linear with a param its forward never uses (its grad must stay None)."""

    def __init__(self, width: int, out: int):
        super().__init__()
        self.linear = nn.Linear(width, out)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, h, scale: float = 1.0):
        return self.linear(h) * scale


class Net(nn.Module):
    def __init__(self, width: int = 32, out: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(12, width), nn.BatchNorm1d(width), nn.GELU(),
                                  nn.Linear(width, width))
        self.head = Head(width, out)

    def forward(self, x):
        return self.head(self.body(x))


# ---- off CUDA: host logic -------------------------------------------------------------------------
def test_structures_flatten_and_come_back():
    t1, t2, t3 = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    obj = ((t1, 3, None), {"k": [t2, "s"], "p": Pair(t3, 1.5)})
    tensors = []
    structure = flatten(obj, tensors)
    assert [t.shape for t in tensors] == [t1.shape, t2.shape, t3.shape]
    back = unflatten(structure, iter(tensors))
    assert back[0][1:] == (3, None) and back[1]["k"][1] == "s" and back[1]["p"].b == 1.5
    assert isinstance(back[1]["p"], Pair) and isinstance(back[1]["k"], list)
    assert back[0][0] is t1 and back[1]["k"][0] is t2 and back[1]["p"].a is t3
    hash(structure)
    other = []
    assert flatten(((t1, 4, None), {"k": [t2, "s"], "p": Pair(t3, 1.5)}), other) != structure  # values count


def test_reached_leaves_are_the_params_the_backward_writes():
    net = Net()
    out = net(torch.randn(6, 12))
    reached = reached_leaves([out])
    ids = {id(p) for p in reached}
    assert ids == {id(p) for n, p in net.named_parameters() if n != "head.unused"}
    assert reached_leaves([out.detach()]) == []


def test_install_and_uninstall_put_the_forward_back():
    net = Net()
    graphed = GraphedModule.install(net.head, name="head")
    assert net.head.forward is graphed and type(net.head).forward is Head.forward
    graphed.uninstall()
    assert "forward" not in net.head.__dict__
    own = net.body.forward  # a forward set on the instance by its user stays theirs
    net.body.forward = own
    g = GraphedModule.install(net.body)
    g.uninstall()
    assert net.body.__dict__["forward"] is own
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got function"):
        GraphedModule(lambda x: x)


def test_a_deep_copy_of_a_graphed_module_has_the_plain_forward():
    net = Net()
    graphed = GraphedModule.install(net)
    twin = copy.deepcopy(net)
    assert not isinstance(twin.__dict__.get("forward"), GraphedModule)
    x = torch.randn(4, 12)
    torch.testing.assert_close(twin(x), net(x), rtol=0, atol=0)
    twin.head.linear.weight.data.add_(1.0)  # a copy, not a view
    assert not torch.equal(twin.head.linear.weight, net.head.linear.weight)
    with pytest.raises(TypeError, match="copy the module, not its graphed forward"):
        copy.deepcopy(graphed)


def test_cpu_calls_run_the_forward_as_is():
    net, ref = Net(), Net()
    GraphedModule.install(net.body)
    x = torch.randn(6, 12)
    torch.testing.assert_close(net(x), ref(x), rtol=0, atol=0)
    net(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert net.body.forward.stats == StepStats()


# ---- on the GPU: replays against eager ------------------------------------------------------------
def batches(n: int, sizes=(32, 24), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows = 17 if i == 5 else sizes[i % len(sizes)]  # one shape seen once: eager, never captured
        out.append((torch.randn(rows, 12, generator=g).cuda(), torch.randn(rows, 5, generator=g).cuda()))
    return out


def train(net: Net, data, *, accumulate: int = 1, set_to_none: bool = True, dtype=None, graphed: bool):
    """SGD with momentum over ``data``; the body and the head graphed separately, from one memory
    pool (the head's input requires grad, the body's does not). Returns the losses and the grads
    seen at each step."""
    pool = GraphPool()
    mods = [GraphedModule.install(net.body, name="body", pool=pool),
            GraphedModule.install(net.head, name="head", pool=pool)] if graphed else []
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], []
    for i, (x, y) in enumerate(data):
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.mse_loss(net.head(net.body(x), scale=0.5).float(), y)
        loss.backward()
        losses.append(loss.detach())
        if (i + 1) % accumulate == 0:
            grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    return losses, grads, mods


def assert_same_training(a: Net, b: Net, run_a, run_b):
    for i, (la, lb) in enumerate(zip(run_a[0], run_b[0])):
        assert torch.equal(la, lb), f"loss {i}: {la.item()} vs {lb.item()}"
    for step, (ga, gb) in enumerate(zip(run_a[1], run_b[1])):
        for k, (x, y) in enumerate(zip(ga, gb)):
            assert (x is None) == (y is None), f"step {step} param {k}: grad None in one run only"
            if x is not None:
                assert torch.equal(x, y), f"step {step} param {k}: max diff {(x - y).abs().max().item()}"
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs"


@cuda
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("accumulate, set_to_none", [(1, True), (2, True), (1, False), (3, False)])
def test_replays_train_exactly_like_eager(dtype, accumulate, set_to_none):
    data = batches(14)
    eager, graphed = Net().cuda(), Net().cuda()
    ref = train(eager, data, accumulate=accumulate, set_to_none=set_to_none, dtype=dtype, graphed=False)
    got = train(graphed, data, accumulate=accumulate, set_to_none=set_to_none, dtype=dtype, graphed=True)
    assert_same_training(eager, graphed, ref, got)
    assert graphed.head.unused.grad is None
    for m in got[2]:
        s = m.stats
        assert s.captures == 2 and s.fallbacks == 0, (s, m.reasons)  # two shapes captured; 17 rows seen once
        assert s.replays == 14 - 3 and s.eager == 3, s  # first sightings: 32, 24, 17


@cuda
def test_a_second_call_before_the_backward_runs_eagerly():
    """A module used twice in one step (shared weights): the second call must not overwrite the
    first replay's activations, so it runs eagerly."""
    def step(net, x, y):
        h = net.body(x)
        loss = F.mse_loss(net.head(h), y) + F.mse_loss(net.head(h * 0.5), y)
        loss.backward()
        return loss.detach()

    eager, graphed = Net().cuda(), Net().cuda()
    head = GraphedModule.install(graphed.head)
    data = batches(6, sizes=(16,))[:4]
    for x, y in data:
        torch.testing.assert_close(step(eager, x, y), step(graphed, x, y))
    for a, b in zip(eager.parameters(), graphed.parameters()):
        # the replay adds its grad to .grad apart from the eager call's, where autograd sums the two
        # uses before one add: equal up to float32 rounding
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    # step 1: eager sighting, then the capture; steps 2-4: a replay, then the second call eagerly
    assert head.stats.replays == 4 and head.stats.eager == 4, (head.stats, head.reasons)


@cuda
def test_a_forward_that_syncs_runs_eagerly_with_its_reason():
    class Syncing(nn.Linear):
        def forward(self, x):
            if x.sum().item() > 1e9:  # a host sync
                x = x * 0
            return super().forward(x)

    torch.manual_seed(0)
    eager = Syncing(12, 5).cuda()
    graphed = copy.deepcopy(eager)
    g = GraphedModule.install(graphed, name="syncing")
    with pytest.warns(RuntimeWarning, match="GraphedModule 'syncing'.*synchronizes with the host"):
        for x, _ in batches(4, sizes=(8,)):
            F.mse_loss(eager(x), x[:, :5]).backward()
            F.mse_loss(graphed(x), x[:, :5]).backward()
    assert torch.equal(eager.weight.grad, graphed.weight.grad)
    assert g.stats.captures == 0 and g.stats.eager == 4 and g.stats.fallbacks == 1
    assert "synchronizes with the host" in next(iter(g.reasons.values()))


@cuda
def test_moved_params_drop_the_graphs_and_training_stays_exact():
    data = batches(10, sizes=(16,))
    eager, graphed = Net().cuda(), Net().cuda()
    body = GraphedModule.install(graphed.body)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.05)
    for i, (x, y) in enumerate(data):
        if i == 5:  # new storage for a weight, as a load or a cast would give
            w = graphed.body[0].weight
            w.data = w.data.clone()
        for net, opt in ((eager, opt_e), (graphed, opt_g)):
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(a, b), name
    # steps 0 eager, 1 captured, 2-4 replayed; 5 (17 rows, the move) eager; 6 eager: the 16-row key
    # starts over after the move; 7 captured again, 8-9 replayed
    assert body.stats.captures == 2 and body.stats.eager == 3, (body.stats, body.reasons)
    assert body.stats.replays == 7


@cuda
def test_a_pool_whose_graphs_are_all_freed_is_replaced_and_captures_go_on():
    # torch cannot share a pool once every graph captured into it is freed: the next capture
    # must start a new one, not fail (and run eagerly for good)
    data = batches(4, sizes=(16,))
    net, pool = Net().cuda(), GraphPool()
    for round_ in range(2):
        body = GraphedModule.install(net.body, pool=pool)
        first = pool.handle()
        for x, y in data:
            F.mse_loss(net(x), y).backward()
        assert body.stats.captures == 1 and body.stats.fallbacks == 0, (round_, body.stats, body.reasons)
        assert pool.handle() == first  # the module's graphs live: later captures share the pool
        body.uninstall()  # frees its graphs
        assert pool.handle() != first


@cuda
def test_eval_and_no_grad_calls_pass_through_and_other_backwards_raise():
    net = Net().cuda()
    g = GraphedModule.install(net.head)
    h = torch.randn(8, 32, device="cuda", requires_grad=True)
    net.eval()
    net.head(h)
    net.train()
    with torch.no_grad():
        net.head(h)
    assert g.stats == StepStats()
    for _ in range(2):  # eager sighting, capture
        net.head(h)
    out = net.head(h)  # a replay
    assert g.stats.replays == 2 and g.stats.eager == 1, (g.stats, g.reasons)
    with pytest.raises(RuntimeError, match=r"autograd.grad\(\) or backward\(inputs=...\)"):
        torch.autograd.grad(out.sum(), h)
    del out  # its replay's backward never ran: the next call would run eagerly while it lives
    gc.collect()  # the frames of the error above, a reference cycle, hold its graph too
    out = net.head(h)
    assert g.stats.replays == 3, (g.stats, g.reasons)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        out.sum().backward(create_graph=True)


@cuda
def test_uninstall_frees_the_graphs_and_leaves_the_last_grads():
    net = Net().cuda()
    g = GraphedModule.install(net.body)
    for x, y in batches(4, sizes=(8,)):
        net.zero_grad()
        F.mse_loss(net(x), y).backward()
    last = net.body[0].weight.grad.clone()
    g.uninstall()
    assert "forward" not in net.body.__dict__
    assert torch.equal(net.body[0].weight.grad, last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.mse_loss(net(x), y).backward()  # the plain forward again
