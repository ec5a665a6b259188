"""One key's graphs of a :class:`~trainfuse.graphs.GraphedModule` (:class:`GraphPair`) and their
replay as an autograd op (:class:`PairReplay`): the forward's replay returns clones of its outputs,
and the op's backward replays a backward graph into the params' kept grads.
:mod:`trainfuse.graphs.module` captures them; its docstring says what the graphs are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import torch

from trainfuse._runtime import compat


@dataclasses.dataclass(eq=False, kw_only=True)  # hashed by identity: a GraphPool holds it in a WeakSet
class GraphPair:
    """One key's graphs: the forward, the backward adding into the kept grads, and the backward
    writing them; the static tensors they read and write."""

    forward: torch.cuda.CUDAGraph
    backward_add: torch.cuda.CUDAGraph | None  # adds the grads into the kept ones
    backward_zero: torch.cuda.CUDAGraph | None  # writes them (the kept grads were None)
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    structure: Hashable  # of the forward's output
    grad_index: tuple[int, ...]  # the outputs that require grad, whose grads the backward takes
    grad_outputs: tuple[torch.Tensor, ...]
    input_grads_add: tuple[torch.Tensor | None, ...]  # per input: its grad after backward_add
    input_grads_zero: tuple[torch.Tensor | None, ...]
    reached: tuple[torch.Tensor, ...]  # the leaves the backward gives a grad
    kept: tuple[torch.Tensor, ...]  # their kept grads
    saved: tuple[torch.Tensor, ...]  # the captured outputs with their autograd graph: what the
    # forward saves for the backward stays allocated in the pool (see GraphPool)
    on_backward: Callable[[], None] | None = None  # told after each backward replay (a gradient sync)

    def replay_forward(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Copy ``tensors`` into the static inputs, replay the forward: clones of its outputs."""
        for static, x in zip(self.inputs, tensors):
            static.copy_(x)
        self.forward.replay()
        return tuple(o.clone() for o in self.outputs)

    def replay_backward(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        """Copy the outputs' ``grads`` into the static buffers, make each reached leaf's ``.grad`` its
        kept tensor again (holding what autograd would add to), and replay the backward that
        fits: the one writing the grads when all of them were None, else the one adding them.

        Returns:
            The static input grads that backward leaves, one per input (None: no grad).
        """
        for static, i in zip(self.grad_outputs, self.grad_index):
            g = grads[i]
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        none, foreign = [], []
        for p, kept in zip(self.reached, self.kept):
            g = p.grad
            if g is kept:
                continue
            if g is None:
                none.append(kept)
            else:
                foreign.append((kept, g))
            p.grad = kept
        if len(none) == len(self.kept):
            self.backward_zero.replay()
            input_grads = self.input_grads_zero
        else:
            if none:
                torch._foreach_zero_(none)
            for kept, g in foreign:
                kept.copy_(g)
            self.backward_add.replay()
            input_grads = self.input_grads_add
        if self.on_backward is not None:
            self.on_backward()
        return input_grads


class PendingBackward:
    """Alive while a replay's backward is still to run (held by the autograd node)."""

    __slots__ = ("__weakref__",)


class PairReplay(torch.autograd.Function):
    """The forward graph's replay as an autograd op; its backward replays a backward graph.

    ``pending`` (None when no output takes a grad) lives as long as this op's backward may still
    run: the module runs eagerly while it does, and the backward lets go of it.
    """

    @staticmethod
    def forward(ctx, who: str, pair: GraphPair, pending: PendingBackward | None, anchor: torch.Tensor,
                *tensors: torch.Tensor):
        outs = pair.replay_forward(tensors)
        fixed = [o for i, o in enumerate(outs) if i not in pair.grad_index]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        ctx.set_materialize_grads(False)
        ctx.who, ctx.pair, ctx.pending = who, pair, pending
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        if torch.is_grad_enabled():
            raise RuntimeError(f"{ctx.who}: a replayed backward cannot build a graph "
                               "(create_graph=True); run the module without graphs for double backward")
        if compat.will_engine_execute_node(ctx.next_functions[0][0]) is not True:
            raise RuntimeError(f"{ctx.who}: autograd.grad() or backward(inputs=...) "
                               "through a replay; its backward writes the params' .grad as backward() "
                               "does, so run the module without graphs for these calls")
        input_grads = ctx.pair.replay_backward(grads)
        ctx.pending = None  # the activations it read may now be overwritten
        needs = ctx.needs_input_grad[4:]  # after who, pair, pending, anchor
        return (None, None, None, None,
                *(g.clone() if need and g is not None else None for g, need in zip(input_grads, needs)))


__all__ = ["GraphPair", "PairReplay", "PendingBackward"]
