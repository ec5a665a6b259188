"""Param grads written by a kernel instead of autograd's AccumulateGrad, where nothing could tell.

AccumulateGrad assigns a leaf's new grad to ``.grad``, or adds it to the grad there in a kernel of
its own: one launch per param and backward, which in a step of small layers is a few percent of
the GPU time (yolov5n: 141 float32 adds an iteration, 0.24 ms on an H200). An op whose backward
forms its params' grads in a kernel of its own (FusedMLP's matmuls, the BatchNorm's reductions)
can write them into ``.grad`` itself, or add onto the grad there, and hand autograd None; it may
do so only where that is what autograd would do and nobody could see the difference:

- the backward builds no graph of the grads (``create_graph``), is not traced by torch.compile,
  and no process group is initialized (DDP and FSDP reduce grads from hooks on the AccumulateGrad
  nodes, which Python cannot see);
- the param's AccumulateGrad node runs in this backward (not ``autograd.grad``, not left out of
  ``backward(inputs=...)``) and the param has no hooks that would see the grad on its way;
- an existing grad is dense, laid out as a fresh one, and not part of a graph.
"""

from __future__ import annotations

import torch

from trainfuse._runtime import compat

NONE, ASSIGN, ADD = 0, 1, 2  # what a kernel does to the params' .grad: nothing, write it, add to it


def may_write(create_graph: bool) -> bool:
    """Whether this backward may write param grads itself at all (the module docstring's first
    rule)."""
    if create_graph or torch.compiler.is_compiling():
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def into_grad(node) -> torch.Tensor | None:
    """The leaf param behind ``node`` (an edge of the op's backward node) if its grad may be
    written by the op itself, as its AccumulateGrad node would: that node runs in this backward,
    and the param has no hooks that would see the grad on its way."""
    if type(node).__name__ != "AccumulateGrad":
        return None
    v = node.variable
    if compat.tensor_grad_hooks(v):
        return None
    try:
        if compat.will_engine_execute_node(node) is not True:
            return None
    except RuntimeError:  # a leaf autograd.grad() captures
        return None
    return v


def fusable(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the existing ``.grad`` ``g`` of ``p`` can be added to in a kernel: dense, laid out
    as a kernel writes a fresh one (row-major, 16-byte aligned), not part of a graph."""
    return (g.layout == torch.strided and not g.requires_grad and g.shape == p.shape
            and g.is_contiguous() and p.is_contiguous() and g.data_ptr() % 16 == 0)


def affine(ctx, at: int, create_graph: bool) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """For a normalization's float32 weight and bias, the tensor inputs ``at`` and ``at + 1`` of
    the op's backward node ``ctx``: ``(ASSIGN, fresh weight grad, fresh bias grad)`` where both
    grads are None, ``(ADD, weight.grad, bias.grad)`` where both can be added to, else
    ``(NONE, None, None)`` (the module docstring's rules; both params or neither)."""
    if not may_write(create_graph):
        return NONE, None, None
    edges = ctx.next_functions
    w, b = into_grad(edges[at][0]), into_grad(edges[at + 1][0])
    if w is None or b is None or w.dtype != torch.float32 or b.dtype != torch.float32:
        return NONE, None, None
    gw, gb = w.grad, b.grad
    if gw is None and gb is None:
        return ASSIGN, torch.empty_like(w, memory_format=torch.contiguous_format), \
            torch.empty_like(b, memory_format=torch.contiguous_format)
    if gw is not None and gb is not None and fusable(gw, w) and fusable(gb, b):
        return ADD, gw, gb
    return NONE, None, None


def hand_over(ctx, at: int, mode: int, gw: torch.Tensor | None, gb: torch.Tensor | None) -> None:
    """After the kernel wrote them (:func:`affine`'s ``ASSIGN``): the fresh grads become the
    params' ``.grad``."""
    if mode == ASSIGN:
        edges = ctx.next_functions
        edges[at][0].variable.grad = gw
        edges[at + 1][0].variable.grad = gb


__all__ = ["ADD", "ASSIGN", "NONE", "affine", "fusable", "hand_over", "into_grad", "may_write"]
