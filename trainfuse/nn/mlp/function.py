"""The autograd Function of a FusedMLP chain: the forward's launches and what it saves, the backward's
launches on one or two streams, and where the param grads go.

What the forward saves: every layer's input (the next layer's weight grad needs it anyway), and
for GELU/SiLU the activation's derivative ``f'(pre)`` rounded to the compute dtype (see
``activations.py``); torch saves the rounded pre-activation and differentiates that, so the two
differ by one rounding of ``f'``. Dropout's mask is never stored: the backward reads it back from
what the forward saves anyway (ReLU's output is zero where dropped; GELU/SiLU's derivative is
stored times the mask and the scale), and draws it again from the seed only where no activation
saved anything. The chain's input is cast to the compute dtype once, as autocast would: two
matmuls read it (the first layer's forward and weight grad), and each ran 1.6-3x slower reading
float32 rows than 16-bit ones (B=2048, D=4096, H200: 320 and 327 us against 106 and 131; the cast
takes about 12 us). The weight grads go straight into the weights' dtype (float32 for float32
params, where torch under autocast rounds them through bf16 first).

The backward runs each layer's weight grad on a side CUDA stream (``streams=2``), overlapping the
next input grad on the main stream. The side stream waits on the main one before each weight
grad; every tensor it reads stays referenced until the main stream has joined it, at the end of
the backward, so the caching allocator cannot hand their memory to another kernel while the side
stream still reads it; the weight grads reach ``.grad`` or autograd only after that join (DDP's
hooks, GradScaler and CUDA-graph capture see an ordinary single-stream backward).
"""

from __future__ import annotations

import torch

from trainfuse._runtime import compat
from trainfuse._runtime.launch import drop_recording, ensure_allocator, finish_recording
from trainfuse.nn.mlp.activations import ACTIVATIONS, DERIV_SAVED, Layer
from trainfuse.nn.mlp.buffers import alternating, carve, param_grads
from trainfuse.nn.mlp.grads import direct_grads, hand_over
from trainfuse.nn.mlp.kernels import EPI_WGRAD
from trainfuse.nn.mlp.launches import (
    act_grad,
    chain_key,
    chain_sites,
    launcher,
    linear_dgrad,
    linear_forward,
    matmul,
    start_chain_recording,
)

_side_streams: dict[int, tuple[torch.cuda.Stream, list[torch.cuda.Event]]] = {}


def _side_stream(device: torch.device, events: int) -> tuple[torch.cuda.Stream, list[torch.cuda.Event]]:
    """The device's side stream and at least ``events`` events to order it after the main one
    (made once: creating an event per wait costs host time in every backward)."""
    side = _side_streams.get(device.index)
    if side is None or len(side[1]) < events:
        stream = torch.cuda.Stream(device) if side is None else side[0]
        side = _side_streams[device.index] = (stream, [torch.cuda.Event() for _ in range(events)])
    return side


class FusedMLPFunction(torch.autograd.Function):
    """The whole chain as one autograd node: ``apply(x, layers, cd, seed, streams, fuse_grads,
    *weights, *biases)`` with ``x`` 2-d; ``biases`` entries may be None. ``fuse_grads``: where
    autograd would, the backward writes the param grads into ``.grad`` itself, adding to existing
    ones in the weight-grad kernel (:func:`trainfuse.nn.mlp.grads.direct_grads`)."""

    @staticmethod
    def forward(ctx, x, layers, cd, seed, streams, fuse_grads, *params):
        n = len(layers)
        weights, biases = params[:n], params[n:]
        grads = any(ctx.needs_input_grad)
        ctx.x_dtype = x.dtype
        if x.dtype != cd:  # rounded as the kernel would round it, once for both matmuls reading it
            x = x.to(cd)
        ctx.key = slots = stream = None
        if x.device.type == "cuda" and launcher.direct():
            ctx.key = chain_key(x, weights, biases, layers, cd, grads)
            slots = chain_sites(ctx.key, n)
            stream = compat.current_raw_stream(x.device.index)
            ensure_allocator()
        rows = x.shape[0]
        # the inner layers' outputs and the saved activation derivatives share one allocation; the
        # chain's output, which the caller keeps, has its own
        keep_pre = [grads and layer.act in DERIV_SAVED and not layer.recompute for layer in layers]
        shapes = [(rows, w.shape[0]) for w in weights[:-1]]
        shapes += [(rows, w.shape[0]) for w, k in zip(weights, keep_pre) if k]
        carved = carve(shapes, cd, x.device)
        outs = carved[:n - 1] + [torch.empty((rows, weights[-1].shape[0]), dtype=cd, device=x.device)]
        pres = iter(carved[n - 1:])
        h = x
        inputs, saved_act = [], []
        if slots is not None:
            start_chain_recording(stream, layers)
        try:
            for i, (layer, w, b) in enumerate(zip(layers, weights, biases)):
                out = outs[i]
                pre = next(pres) if keep_pre[i] else None
                linear_forward(h, w, b, out, pre, cd, layer.act, seed + i, layer.p, stream,
                               None if slots is None else slots[i])
                inputs.append(h)
                saved_act.append(pre if keep_pre[i] else out if layer.act == ACTIVATIONS["relu"] else None)
                h = out
        except BaseException:
            drop_recording()
            raise
        if slots is not None:
            finish_recording(slots.replays, x.device)
        ctx.layers, ctx.cd, ctx.seed, ctx.streams, ctx.fuse_grads = layers, cd, seed, streams, fuse_grads
        ctx.has_bias = [b is not None for b in biases]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        # recomputing a layer's forward takes its bias too
        ctx.recomputes = grads and any(layer.recompute and layer.act in DERIV_SAVED for layer in layers)
        empty = inputs[0].new_empty(0)
        ctx.save_for_backward(*inputs, *[s if s is not None else empty for s in saved_act], *weights,
                              *([b if b is not None else empty for b in biases] if ctx.recomputes else []))
        return h

    @staticmethod
    def backward(ctx, grad):
        # once_differentiable runs the backward under no_grad: whether autograd builds a graph of
        # the grads (create_graph), which decides how it accumulates them, is seen out here
        ctx.create_graph = torch.is_grad_enabled()
        return FusedMLPFunction._backward(ctx, grad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward(ctx, grad):
        layers, n = ctx.layers, len(ctx.layers)
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_w = need[6:6 + n]
        need_b = [need[6 + n + i] and ctx.has_bias[i] for i in range(n)]
        direct = (direct_grads(ctx, n, need_w, need_b) if ctx.fuse_grads else None) or [None] * n
        accum = tuple(d and d[2] for d in direct)
        device = grad.device
        two = ctx.streams == 2 and device.type == "cuda"
        grad = grad.contiguous()
        slots = main_raw = None
        if ctx.key is not None and launcher.direct():
            # each layer's weight grad and input grad, and its recomputed forward if any
            # ... and the last activation's grad (the last site)
            slots = chain_sites((ctx.key, grad.dtype, grad.data_ptr() % 16, need, two, accum),
                                 (3 * n if ctx.recomputes else 2 * n) + 1)
            main_raw = compat.current_raw_stream(device.index)
            ensure_allocator()
            if not two:  # two streams: the side stream's waits are not recorded
                start_chain_recording(main_raw, layers)
        try:
            dx, gw, gb, alive = FusedMLPFunction._launch_backward(ctx, grad, saved, direct, accum, slots,
                                                                  main_raw, two)
        except BaseException:
            drop_recording()
            raise
        if slots is not None and not two:
            finish_recording(slots.replays, device)
        del alive
        gb = [g if need_b[i] else None for i, g in enumerate(gb)]
        hand_over(direct, gw, gb)
        return (dx, None, None, None, None, None, *gw, *gb)

    @staticmethod
    def _launch_backward(ctx, grad, saved, direct, accum, slots, main_raw, two):
        """The backward's launches (recorded, when :func:`start_chain_recording` turned it on): the last
        activation's grad, then per layer from the last its weight grad (on the side stream with
        ``two``) and input grad. Returns the input's grad (or None), the weight and bias grads and
        the scratch tensors the launches use (kept until recorded launches have been made)."""
        layers, cd, n = ctx.layers, ctx.cd, len(ctx.layers)
        inputs, acts, weights = saved[:n], saved[n:2 * n], saved[2 * n:3 * n]
        need = ctx.needs_input_grad
        need_x = need[0]
        need_w = need[6:6 + n]
        need_b = [need[6 + n + i] and ctx.has_bias[i] for i in range(n)]
        device = grad.device
        main = torch.cuda.current_stream(device) if two else None
        side, events = _side_stream(device, n + 1) if two else (None, None)
        side_raw = side.cuda_stream if two else None  # launched on directly: no stream switches
        keep = []  # tensors the side stream reads: alive until the main stream has joined it
        rows = grad.shape[0]
        biases = [b if ctx.has_bias[j] else None for j, b in enumerate(saved[3 * n:])]
        alive = []

        def saved_act(j: int) -> torch.Tensor | None:
            """What layer ``j``'s activation grad reads; a derivative the forward did not save is
            made now, just before its one use, by running the layer's forward matmul again (the
            same launch shape, so the same bits as if saved)."""
            layer = layers[j]
            if not layer.act:
                return None
            if layer.recompute and layer.act in DERIV_SAVED:
                out_j, deriv = carve([(rows, weights[j].shape[0])] * 2, cd, device)
                alive.append(out_j)
                linear_forward(inputs[j], weights[j], biases[j], out_j, deriv, cd, layer.act, ctx.seed + j,
                               layer.p, main_raw, None if slots is None else slots[2 * n + j])
                return deriv
            return acts[j]

        last = layers[-1]
        first_act = bool(last.act or last.p > 0.0)
        # the last activation's grad and the inner layers' input grads, in the order they are
        # written, from one allocation: each its own slice with two streams (the side stream reads
        # them until the join), two slices taking turns with one; the weight and bias grads of
        # each dtype share one allocation too (autograd takes such a view as the param's .grad as
        # it is, no copy: it is contiguous and the only reference)
        written = ([tuple(grad.shape)] if first_act else []) + [(rows, weights[i].shape[1])
                                                                for i in range(n - 1, 0, -1)]
        inner = (carve if two else alternating)(written, cd, device)
        alive.append(inner)
        # a grad added to in place is the kernel's output; the others are made here
        gw, gb = param_grads(weights, ctx.bias_dtypes, [w and not a for w, a in zip(need_w, accum)],
                              [b and not a for b, a in zip(need_b, accum)], device)
        for i, d in enumerate(direct):
            if d is not None and d[2]:
                gw[i], gb[i] = d[0].grad, d[1].grad if d[1] is not None else None
        if first_act:
            dpre = inner[0]
            act_grad(grad, saved_act(n - 1) if last.act else grad, dpre, last.act, ctx.seed + n - 1, last.p,
                     main_raw, None if slots is None else slots[-1])
        else:
            dpre = grad
        dx = None
        for i in reversed(range(n)):
            w = weights[i]
            if need_w[i] or need_b[i]:
                if two:
                    events[i].record(main)
                    side.wait_event(events[i])
                    keep.append(dpre)
                slot = None if slots is None else slots[2 * i]
                stream = side_raw if two else main_raw
                if slot is not None and slot.run is not None:
                    db = gw[i] if gb[i] is None else gb[i]
                    slot.launch(stream, dpre, inputs[i], gw[i], db, gw[i], 0, 0.0)
                else:
                    matmul(dpre.t(), inputs[i], gw[i], cd, EPI_WGRAD, db=gb[i], accumulate=bool(accum[i]),
                           stream=stream, slot=slot)
            if i > 0:
                prev = layers[i - 1]
                out = inner[first_act + n - 1 - i]
                linear_dgrad(dpre, w, out, cd, prev.act, saved_act(i - 1), ctx.seed + i - 1,
                             prev.p, main_raw, None if slots is None else slots[2 * i + 1])
                dpre = out
            elif need_x:
                dx = torch.empty(inputs[0].shape, dtype=ctx.x_dtype, device=device)
                linear_dgrad(dpre, w, dx, cd, 0, None, 0, 0.0, main_raw, None if slots is None else slots[1])
        if two:
            events[n].record(side)
            main.wait_event(events[n])
            del keep
        return dx, gw, gb, alive


__all__ = ["FusedMLPFunction", "Layer"]
