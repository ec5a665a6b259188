"""Grad accumulation without AccumulateGrad: where autograd would assign or add a param's grad and
nothing could tell the difference, FusedMLP's backward writes the grad into ``.grad`` itself, and
onto an existing grad its weight-grad kernel starts the accumulator from the grad's tile (one pass
over it, where autograd would run an add kernel per param). Elsewhere the grads go back to
autograd as any Function's would. This file decides which."""

from __future__ import annotations

import torch

from trainfuse._runtime import compat


def _into_grad(node) -> torch.Tensor | None:
    """The leaf param behind ``node`` (an edge of the chain's backward node) if its grad may be
    written by the chain itself, as its AccumulateGrad node would: that node runs in this
    backward (not ``autograd.grad``, not left out of ``backward(inputs=...)``), and the param has
    no hooks that would see the grad on its way (tensor hooks, post-accumulate hooks)."""
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


def _fusable(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the existing ``.grad`` ``g`` of ``p`` can be added to in the kernel: dense, laid
    out as the kernel writes a fresh one (row-major, 16-byte aligned), not part of a graph."""
    return (g.layout == torch.strided and not g.requires_grad and g.shape == p.shape
            and g.is_contiguous() and p.is_contiguous() and g.data_ptr() % 16 == 0)


def direct_grads(ctx, n: int, need_w, need_b) -> list[tuple | None] | None:
    """Per layer, ``(weight, bias or None, accumulate)`` where the backward writes the layer's
    param grads into ``.grad`` itself instead of returning them to autograd (whose AccumulateGrad
    would then assign them, or add them to an existing grad in a kernel of its own), else None.

    Only where that is what autograd would do and nobody could tell: grad mode off (no
    ``create_graph``), no process group (DDP and FSDP reduce grads from hooks on the
    AccumulateGrad nodes that Python cannot see), not under torch.compile, both of the layer's
    params (:func:`_into_grad`), and their grads both None (assign) or both fusable (add)."""
    if ctx.create_graph or torch.compiler.is_compiling():
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    edges = ctx.next_functions  # the tensor inputs that need grads: x, the weights, the biases there are
    bias_edge = 1 + n
    direct: list[tuple | None] = [None] * n
    for i in range(n):
        has_bias = ctx.has_bias[i]
        if need_w[i] and (need_b[i] or not has_bias):
            w = _into_grad(edges[1 + i][0])
            b = _into_grad(edges[bias_edge][0]) if has_bias else None
            if w is not None and (b is not None or not has_bias):
                gw, gb = w.grad, None if b is None else b.grad
                if gw is None and gb is None:
                    direct[i] = (w, b, False)
                elif (gw is not None and _fusable(gw, w)
                      and (b is None or (gb is not None and _fusable(gb, b)))):
                    direct[i] = (w, b, True)
        bias_edge += has_bias
    return direct


def hand_over(direct: list[tuple | None], gw: list, gb: list) -> None:
    """Where ``direct`` (:func:`direct_grads`) says so, put a layer's new weight and bias grads
    into ``.grad`` (an accumulating layer's kernel already added to them) and clear its entries in
    ``gw`` and ``gb``, which go back to autograd: it must not add them a second time."""
    for i, d in enumerate(direct):
        if d is not None:
            if not d[2]:
                d[0].grad = gw[i]
                if d[1] is not None:
                    d[1].grad = gb[i]
            gw[i] = gb[i] = None


__all__ = ["direct_grads", "hand_over"]
