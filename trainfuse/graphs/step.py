"""A whole step (forward, loss, backward, optimizer update) captured in CUDA graphs, one per input shape.

A small model's step is hundreds of short kernels whose launches, not their math, set its time; a
CUDA graph launches them all at once. :class:`CapturedStep` wraps a step ``fn(*tensors)`` and, per
key (the inputs' shapes, strides, dtypes and device, plus the caller's ``bucket``), follows
:class:`~trainfuse.graphs.cache.ShapeCache`'s policy:

1. first sighting: ``fn`` runs eagerly, on the side stream captures use. This is the warm-up a
   capture needs: lazily made state (optimizer state, ``.grad``, that stream's library workspaces)
   exists before the capture, so the graph updates it in place;
2. second sighting: the inputs are copied into static buffers (same shape, dtype, strides), one call
   of ``fn`` on them is captured (kernels recorded, not run) into a graph sharing a memory pool with
   this step's other graphs, and the graph is replayed once to do this call's work: each call does
   the step's work once. ``warmup`` adds eager calls before the capture; it defaults to 0 because
   for a training step each one is an extra optimizer step on this batch;
3. later sightings: the inputs are copied into the static buffers (on the GPU, no host sync) and the
   graph is replayed.

Python runs only at capture, so a replay repeats what ``fn`` decided then: Python numbers are baked
in (a learning rate that changes must be a CUDA tensor updated in place, e.g. torch's
``Adam(lr=torch.tensor(..., device="cuda"), capturable=True)``), and state that picks the kernels
(grad mode, autocast, ``module.train()``) must go in ``bucket=`` to get a graph per value. Tensors
``fn`` keeps across calls must exist before the capture and be updated in place
(``zero_grad(set_to_none=False)``): one made during a capture lives in the shared pool, where
another key's replay may overwrite it.

A capture that fails (a host sync such as ``.item()`` in ``fn``: "operation not permitted when stream
is capturing"; any exception) is ended and dropped, its key runs eagerly from then on, the step's
first failure warns once (:class:`RuntimeWarning`), and the call runs ``fn`` eagerly. No kernel of the
failed attempt ran, but its Python side effects (counters ``fn`` increments, attributes it set) did.
This bookkeeping is :class:`~trainfuse.graphs.ledger.GraphLedger`'s, shared with
:class:`~trainfuse.graphs.GraphedModule`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import torch

from trainfuse.graphs.cache import Action
from trainfuse.graphs.ledger import GraphLedger, LedgerReports
from trainfuse.graphs.pool import GraphPool
from trainfuse.graphs.sync import captured, on_side_stream, side_stream
from trainfuse.graphs.tree import constants, flatten, unflatten


@dataclasses.dataclass(eq=False, kw_only=True)  # hashed by identity: a GraphPool holds it in a WeakSet
class _Graph:
    """One key's captured graph, the static buffers it reads its inputs from, and what it returns."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: list[torch.Tensor]  # fn's output tensors (static, detached), in the order of...
    structure: Hashable  # ...fn's output structure (tree.flatten), rebuilt in fresh containers per call


def _static_outputs(out: Any) -> tuple[list[torch.Tensor], Hashable]:
    """``fn``'s output tensors, detached, and its structure; TypeError naming the first value a
    replay could not reproduce (anything but tensors, None, and tuples, lists and dicts of them)."""
    tensors: list[torch.Tensor] = []
    structure = flatten(out, tensors)
    for where, value in constants(structure, "fn's output"):
        if value is not None:
            raise TypeError(f"{where} is a Python {type(value).__name__}; a replayed graph returns only "
                            f"tensors, None, and tuples, lists and dicts of them (return a tensor instead)")
    return [t.detach() for t in tensors], structure


class CapturedStep(LedgerReports):
    """``fn(*inputs)``, captured in a CUDA graph per input shape from its second call on, else eager.

    Args:
        fn: the step; takes CUDA tensors (the batch) and returns None, a tensor, or a tuple, list or
            dict of tensors. Everything else it uses (model, optimizer, loss) comes from its closure.
        max_graphs: graphs kept at once; the least recently used is dropped beyond it.
        warmup: extra eager calls of ``fn`` on the static inputs right before a capture. Each is a
            full call (a training step: one more update on this batch); the eager first sighting
            already warms up, so 0 unless ``fn`` needs more (torch's docs ask 11 for
            DistributedDataParallel).
        pool: a memory pool (``torch.cuda.graph_pool_handle()``) to capture into; None: one of this
            step's own, made at its first capture and shared by all its graphs. After a failed
            capture, later ones start a fresh pool.
        name: how warnings and errors call this step.

    A call returns what ``fn`` returns. On a replay, those are the graph's static tensors, detached:
    the next replay overwrites them (and, the pool being shared, so may another key's). Clone what
    must outlive the next call.

    Inputs must be CUDA tensors on one device, not requiring grad (they are copied into the graph's
    buffers, so no gradient could reach them); else :class:`TypeError` (not a tensor) or
    :class:`ValueError` (a CPU tensor, the rest) before ``fn`` runs. CPU tensors raise rather than
    run eagerly so that a step meant to be captured never runs uncaptured unnoticed; a caller with
    a CPU path calls ``fn`` itself there. Call from one thread and one current stream: replays of
    a graph on two streams at once would race on its buffers.

    Example::

        def train_step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        step = CapturedStep(train_step)
        for x, y in loader:
            loss = step(x.cuda(), y.cuda())   # eager, then captured + replayed, then replayed
    """

    def __init__(self, fn: Callable[..., Any], *, max_graphs: int = 8, warmup: int = 0,
                 pool: Any = None, name: str = "step") -> None:
        if not callable(fn):
            raise TypeError(f"CapturedStep: fn must be callable, got {type(fn).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"CapturedStep: warmup must be an int >= 0, got {warmup!r}")
        self.fn = fn
        self.warmup = warmup
        self._ledger: GraphLedger[_Graph] = GraphLedger(
            "CapturedStep", name, max_graphs=max_graphs, pool=GraphPool(pool),
            eagerly="inputs of this shape run eagerly from now on")

    def __call__(self, *inputs: torch.Tensor, bucket: Hashable = None) -> Any:
        """Run the step on ``inputs``: eagerly, by capturing then replaying, or by replaying.

        Args:
            inputs: the CUDA tensors ``fn`` takes.
            bucket: Python-side state that changes what ``fn`` launches for inputs of equal
                shapes (the last micro-batch of an accumulation, eval vs train): each value gets
                its own graph.

        Returns:
            What ``fn`` returns; on a replay, the graph's static output tensors (see the class).
        """
        ledger = self._ledger
        key, device = self._key(inputs, bucket)
        ledger.device = device
        action, entry = ledger.lookup(key)
        if action is Action.REPLAY:
            for static, x in zip(entry.inputs, inputs):
                static.copy_(x, non_blocking=True)
        elif action is Action.CAPTURE:
            entry = self._capture(key, inputs, device)  # its static inputs hold this call's
        if entry is not None:
            entry.graph.replay()
            ledger.replayed()
            return unflatten(entry.structure, iter(entry.outputs))
        ledger.ran_eagerly()
        if action is not Action.EAGER:  # the key's capture failed, now or before
            return self.fn(*inputs)
        return ledger.first_sighting(key, device, "fn", self.fn, *inputs)

    def _key(self, inputs: tuple, bucket: Hashable) -> tuple[tuple, torch.device]:
        """The cache key of a call, after checking its inputs (nothing has run yet if this raises)."""
        who = self._ledger.who
        if not inputs:
            raise ValueError(f"{who}: no inputs; fn must take the batch as CUDA tensors "
                             f"(a replay reads only the tensors passed in)")
        parts: list[Hashable] = [bucket]
        device = None
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{who}: input {i} is a {type(x).__name__}; inputs must be CUDA "
                                f"tensors (pass other values through fn's closure or bucket=)")
            if not x.is_cuda:
                raise ValueError(f"{who}: input {i} is on {x.device}; CapturedStep needs CUDA "
                                 f"tensors (call fn directly off CUDA)")
            if x.requires_grad:
                raise ValueError(f"{who}: input {i} requires grad; inputs are copied into the "
                                 f"graph's buffers, so no gradient would reach them (pass x.detach())")
            if device is None:
                device = x.device
            elif x.device != device:
                raise ValueError(f"{who}: input {i} is on {x.device}, input 0 on {device}; "
                                 f"a graph runs on one device")
            parts.append((x.shape, x.stride(), x.dtype))
        parts.append(device)
        return tuple(parts), device

    def _capture(self, key: tuple, inputs: tuple, device: torch.device) -> _Graph | None:
        """Capture ``fn`` on static copies of ``inputs`` and store the graph (not yet replayed); on
        failure, mark ``key`` eager for good and return None, with nothing of ``fn`` run on the GPU."""
        ledger = self._ledger
        ledger.before_capture(device)
        pool = ledger.pool.handle()
        static = tuple(torch.empty_like(x, memory_format=torch.preserve_format) for x in inputs)
        for s, x in zip(static, inputs):
            s.copy_(x)
        for _ in range(self.warmup):
            on_side_stream(device, self.fn, *static)
        side, current = side_stream(device), torch.cuda.current_stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph, out = captured(pool, self.fn, *static)
            outputs, structure = _static_outputs(out)
        except Exception as e:  # a host sync, anything fn raised, an output a replay cannot return;
            # or this call is inside a capture of the caller's
            ledger.capture_failed(key, e)
            return None
        finally:
            current.wait_stream(side)
        entry = _Graph(graph=graph, inputs=static, outputs=outputs, structure=structure)
        ledger.store(key, entry)
        return entry


__all__ = ["CapturedStep"]
