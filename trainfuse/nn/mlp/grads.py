"""Grad accumulation without AccumulateGrad: where autograd would assign or add a param's grad and
nothing could tell the difference (:mod:`trainfuse.nn.param_grads`), FusedMLP's backward writes the
grad into ``.grad`` itself, and onto an existing grad its weight-grad kernel starts the accumulator
from the grad's tile (one pass over it, where autograd would run an add kernel per param).
Elsewhere the grads go back to autograd as any Function's would. This file decides which."""

from __future__ import annotations

from trainfuse.nn.param_grads import fusable, into_grad, may_write


def direct_grads(ctx, n: int, need_w, need_b) -> list[tuple | None] | None:
    """Per layer, ``(weight, bias or None, accumulate)`` where the backward writes the layer's
    param grads into ``.grad`` itself instead of returning them to autograd (whose AccumulateGrad
    would then assign them, or add them to an existing grad in a kernel of its own), else None.

    Only where that is what autograd would do and nobody could tell: grad mode off (no
    ``create_graph``), no process group (DDP and FSDP reduce grads from hooks on the
    AccumulateGrad nodes that Python cannot see), not under torch.compile, both of the layer's
    params (:func:`~trainfuse.nn.param_grads.into_grad`), and their grads both None (assign) or
    both fusable (add)."""
    if not may_write(ctx.create_graph):
        return None
    edges = ctx.next_functions  # the tensor inputs that need grads: x, the weights, the biases there are
    bias_edge = 1 + n
    direct: list[tuple | None] = [None] * n
    for i in range(n):
        has_bias = ctx.has_bias[i]
        if need_w[i] and (need_b[i] or not has_bias):
            w = into_grad(edges[1 + i][0])
            b = into_grad(edges[bias_edge][0]) if has_bias else None
            if w is not None and (b is not None or not has_bias):
                gw, gb = w.grad, None if b is None else b.grad
                if gw is None and gb is None:
                    direct[i] = (w, b, False)
                elif (gw is not None and fusable(gw, w)
                      and (b is None or (gb is not None and fusable(gb, b)))):
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
