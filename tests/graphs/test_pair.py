"""GraphPair and PairReplay off CUDA, with stand-in graphs whose replay runs a recorded function:
a pair is built by keyword only; the replay joins autograd as the captured module would, puts each
param's kept grad back in ``.grad``, picks the writing or the adding backward, and lets the module
replay again once its backward ran."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from trainfuse.graphs.pair import GraphPair, PairReplay, PendingBackward

WHO = "GraphedModule 'scale'"


class Recorded:
    """A stand-in for a CUDA graph: ``replay()`` runs ``work`` and counts."""

    def __init__(self, work):
        self.work, self.replays = work, 0

    def replay(self) -> None:
        self.work()
        self.replays += 1


def scale_pair(weight: torch.Tensor, kept: torch.Tensor, bias: torch.Tensor | None = None,
               kept_bias: torch.Tensor | None = None) -> GraphPair:
    """The graphs of ``y = x * weight (+ bias)``, with ``kept`` (and ``kept_bias``) the kept grads."""
    x, y, dy, dx_add, dx_zero = (torch.zeros(3) for _ in range(5))
    w = weight.detach()
    b = torch.zeros(3) if bias is None else bias.detach()

    def forward():
        y.copy_(x * w + b)

    def backward(add: bool):
        (kept.add_ if add else kept.copy_)(dy * x)
        if kept_bias is not None:
            (kept_bias.add_ if add else kept_bias.copy_)(dy)
        (dx_add if add else dx_zero).copy_(dy * w)

    reached, kept_grads = ((weight,), (kept,)) if bias is None else ((weight, bias), (kept, kept_bias))
    return GraphPair(forward=Recorded(forward), backward_add=Recorded(lambda: backward(True)),
                     backward_zero=Recorded(lambda: backward(False)), inputs=(x,), outputs=(y,),
                     structure=None, grad_index=(0,), grad_outputs=(dy,), input_grads_add=(dx_add,),
                     input_grads_zero=(dx_zero,), reached=reached, kept=kept_grads, saved=())


def replay(pair: GraphPair, x: torch.Tensor, pending: PendingBackward | None = None) -> torch.Tensor:
    (y,) = PairReplay.apply(WHO, pair, pending, torch.empty(0, requires_grad=True), x)
    return y


def test_a_pair_is_built_by_keyword_only():
    fields = [f.name for f in dataclasses.fields(GraphPair)]
    assert len(fields) == 14
    with pytest.raises(TypeError):
        GraphPair(*[None] * len(fields))
    pair = GraphPair(**{name: None for name in fields})
    assert pair.kept is None and pair.saved is None and pair.on_backward is None


def test_pairs_are_hashed_by_identity():
    """A GraphPool holds pairs in a WeakSet: two pairs with equal fields are two owners."""
    fields = {f.name: () for f in dataclasses.fields(GraphPair)}
    a, b = GraphPair(**fields), GraphPair(**fields)
    assert a != b and len(weakref.WeakSet([a, b])) == 2


def test_the_forward_replay_reads_each_calls_input_and_returns_clones():
    pair = scale_pair(torch.tensor([1.0, 2.0, 3.0], requires_grad=True), torch.zeros(3))
    y = replay(pair, torch.tensor([2.0, 2.0, 2.0]))
    assert torch.equal(y, torch.tensor([2.0, 4.0, 6.0]))
    assert y.data_ptr() != pair.outputs[0].data_ptr()  # a clone: the next replay cannot overwrite it
    assert pair.forward.replays == 1


def test_a_backward_after_zero_grad_writes_the_kept_grads():
    weight = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    kept = torch.full((3,), 99.0)  # what an earlier step left: written over, not added to
    pair = scale_pair(weight, kept)
    x = torch.tensor([1.0, -1.0, 2.0], requires_grad=True)
    replay(pair, x).sum().backward()
    assert weight.grad is kept and torch.equal(kept, x.detach())
    assert torch.equal(x.grad, weight.detach())
    assert (pair.backward_zero.replays, pair.backward_add.replays) == (1, 0)


def test_backwards_accumulate_into_the_kept_grads():
    weight = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    pair = scale_pair(weight, torch.zeros(3))
    x = torch.tensor([1.0, -1.0, 2.0])
    replay(pair, x).sum().backward()
    replay(pair, x).sum().backward()  # .grad is the kept tensor: the graph adds into it
    assert torch.equal(weight.grad, 2 * x)
    assert (pair.backward_zero.replays, pair.backward_add.replays) == (1, 1)


def test_a_grad_put_there_by_the_user_is_added_to():
    weight = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    kept = torch.zeros(3)
    pair = scale_pair(weight, kept)
    weight.grad = torch.full((3,), 10.0)
    x = torch.tensor([1.0, -1.0, 2.0])
    replay(pair, x).sum().backward()
    assert weight.grad is kept and torch.equal(kept, x + 10.0)
    assert pair.backward_add.replays == 1


def test_a_grad_set_to_none_since_is_zeroed_before_the_others_add():
    weight, bias = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    kept_bias = torch.full((3,), 99.0)
    pair = scale_pair(weight, torch.zeros(3), bias, kept_bias)
    x = torch.tensor([1.0, -1.0, 2.0])
    replay(pair, x).sum().backward()
    bias.grad = None  # the weight's grad accumulates, the bias's starts over
    replay(pair, x).sum().backward()
    assert torch.equal(weight.grad, 2 * x)
    assert bias.grad is kept_bias and torch.equal(kept_bias, torch.ones(3))
    assert (pair.backward_zero.replays, pair.backward_add.replays) == (1, 1)


def test_the_backward_lets_the_module_replay_again():
    """The pending token lives while the backward may run, and no longer, even if the loss lives on."""
    pair = scale_pair(torch.ones(3, requires_grad=True), torch.zeros(3))
    pending = PendingBackward()
    alive = weakref.ref(pending)
    loss = replay(pair, torch.ones(3), pending).sum()
    del pending
    gc.collect()
    assert alive() is not None
    loss.backward(retain_graph=True)
    assert alive() is None


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_backwards_a_replay_cannot_run_raise_naming_the_module():
    pair = scale_pair(torch.ones(3, requires_grad=True), torch.zeros(3))
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"GraphedModule 'scale': autograd.grad\(\) or backward\(inputs"):
        torch.autograd.grad(replay(pair, x).sum(), x)
    with pytest.raises(RuntimeError, match="GraphedModule 'scale': a replayed backward cannot build a graph"):
        replay(pair, x).sum().backward(create_graph=True)
