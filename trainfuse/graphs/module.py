"""A module's forward and backward replayed from CUDA graphs inside an eager training step.

:class:`~trainfuse.graphs.CapturedStep` takes a whole step, which must then be a function of its
batch alone. A framework's step (Lightning's ``training_step``) runs the user's Python around the
model: logging, counters, lists of losses, hooks. A replay would skip all of it. A
:class:`GraphedModule` graphs less: one module's forward, and its backward, as CUDA graphs per
input key, joined to autograd by one Function. The code around the module runs as written every
step: the loss, ``self.log``, hooks, ``zero_grad``, the optimizer.

Per key (the tensor arguments' shapes, strides, dtypes, devices and ``requires_grad``, the other
arguments' values, and the autocast state), a call in training mode with grad enabled:

1. first sighting: runs the forward eagerly on the capture stream under torch's sync debug mode;
   a host sync marks the key eager for good (a capture of it would fail);
2. second sighting: captures the forward (the autocast weight cache off inside: a cached cast
   from outside the graph would be freed under it), then the backward from static grad buffers
   (``autograd.grad`` over the params it reaches), twice: adding the grads into the kept grads
   (below), and writing them there. Then replays the forward;
3. later sightings: copies the tensor arguments into the static buffers and replays the forward.

The outputs come back as clones (they outlive the next replay) from a Function whose backward
copies the incoming grads into the static buffers and replays a backward graph
(:mod:`trainfuse.graphs.pair`).

**Grads.** A graph writes to fixed addresses, so each param the backward gives a grad keeps one
grad tensor (its "kept" grad). Before a backward replay every such param's ``.grad`` becomes its
kept tensor again, holding what autograd would have added to: nothing for a grad that was None
(after ``zero_grad(set_to_none=True)``: when all are None the graph writes the grads instead of
adding them), a copy of another tensor a user put there, or the kept tensor as it is (gradient
accumulation). Params that get no grad keep theirs as it is (None stays None). The add is its
own multi-tensor kernel in the graph, as autograd's AccumulateGrad adds per param; modules that
fuse it into their weight-grad kernel eagerly (FusedMLP) round the sum once less there.

**Gradient sync.** Under data parallelism the caller may pass ``sync`` (:class:`BackwardSync`),
which says per call whether this backward ends the step's accumulation (``sync.active()``, part of
the key: such calls get graphs of their own). Those backwards are captured with a hook on every
leaf, which hands each grad to ``sync.start(...)``'s launch as autograd produces it, so the launch
can add a bucket of grads in and start its all-reduce while the rest of the backward runs; the
launch's ``finish()`` joins them before the graph ends. A replay of such a backward tells the caller
(``sync.replayed()``) that the step's grads are reduced.

**Memory.** The graphs allocate from a :class:`GraphPool`, the module's own or one shared with the
other graphed modules of the step (what keeps sharing safe is in its docstring). The allocator's
cache is emptied before a capture, so that blocks cached by earlier eager steps do not sit beside
the pool.

**Eager calls.** With one warning (the first) and the reason in :attr:`GraphedModule.reasons`: a
host sync in the forward, a capture that fails; with the warning only, as there is no key to list:
an argument that is neither a tensor nor hashable. The bookkeeping is
:class:`~trainfuse.graphs.ledger.GraphLedger`'s, shared with ``CapturedStep``. Without either:
eval mode, grad mode off, CPU tensors, a call inside another graphed call or a capture, and a call
made while an earlier replay's backward is still to run (its activations live in the graphs'
memory, which the next replay overwrites). Params or buffers that move (``.data`` set, ``.to()``)
drop the graphs: keys start over as unseen.

A replay repeats what the forward decided at capture: Python attributes the forward sets and
branches on anything but the key are baked in, as for :class:`~trainfuse.graphs.CapturedStep`.
A backward through a replay must be a plain ``backward()``: ``create_graph=True``,
``autograd.grad()`` and ``backward(inputs=...)`` raise (the replay writes the params' ``.grad``).
"""

from __future__ import annotations

import copy
import functools
import threading
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
from torch import nn

from trainfuse.graphs.cache import Action
from trainfuse.graphs.ledger import GraphLedger, LedgerReports
from trainfuse.graphs.pair import GraphPair, PairReplay, PendingBackward
from trainfuse.graphs.pool import GraphPool
from trainfuse.graphs.sync import captured, side_stream
from trainfuse.graphs.tree import flatten, reached_leaves, unflatten

_state = threading.local()  # .depth: graphed calls and captures running in this thread


def _hand_over(launch: BackwardLaunch, position: int, grad: torch.Tensor) -> None:
    launch.ready(position, grad)  # a leaf's hook: returns None, so autograd keeps the grad as it is


class BackwardLaunch(Protocol):
    """One backward's gradient sync (see :class:`BackwardSync`)."""

    positions: frozenset[int]  # the leaves (positions in the backward's list) it adds in itself

    def ready(self, position: int, grad: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


class BackwardSync(Protocol):
    """What a data-parallel caller gives a :class:`GraphedModule` to reduce grads inside its
    backward graphs (:class:`trainfuse.clients.GradBuckets` behind a client's change)."""

    def active(self) -> bool:
        """Whether the call now starting ends the step's accumulation (its backward reduces)."""

    def start(self, leaves: list[torch.Tensor], kept: list[torch.Tensor],
              zero: bool) -> BackwardLaunch | None:
        """A launch for a backward over ``leaves`` into ``kept`` (written with ``zero``, else
        added), or None when it cannot reduce them all (the backward then reduces nothing)."""

    def replayed(self) -> None:
        """A backward that reduced the grads was replayed."""


class _Inside:
    """Marks a graphed call in progress: graphed modules called inside it run their forward as is."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1


class GraphedModule(LedgerReports):
    """``module``'s forward and backward from CUDA graphs per input key; see the module docstring.

    Made by :meth:`install`, which puts it in place of ``module.forward``; :meth:`uninstall`
    takes it out and frees the graphs.

    Args:
        module: the module whose forward (and that forward's backward) is graphed.
        max_graphs: keys kept captured at once (each holds three graphs); the least recently used
            is dropped beyond it.
        name: how warnings and reports call it.
        pool: a :class:`GraphPool` shared with the other graphed modules of the step (one stream);
            by default the module has a pool of its own.
        grads: the kept grad of a param, where the caller owns it (a view of a flat buffer for
            one all-reduce, :class:`trainfuse.clients.FlatGrads`), or None to let the graphs
            allocate one.
        sync: the gradient sync of a data-parallel caller (see the module docstring), or None.
    """

    def __init__(self, module: nn.Module, *, max_graphs: int = 8, name: str = "module",
                 pool: GraphPool | None = None,
                 grads: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 sync: BackwardSync | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"GraphedModule: module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self._own = module.__dict__.get("forward")  # an instance-level forward the user set, if any
        self._original = module.forward
        self._ledger: GraphLedger[GraphPair] = GraphLedger(
            "GraphedModule", name, max_graphs=max_graphs, pool=GraphPool() if pool is None else pool,
            eagerly="these calls run eagerly")
        self._pending: weakref.ref | None = None
        self._anchor: torch.Tensor | None = None
        self._kept: dict[int, torch.Tensor] = {}
        self._grads = grads
        self._sync = sync
        self._watched = list(module.parameters()) + list(module.buffers())
        self._layout = self._signature()

    @classmethod
    def install(cls, module: nn.Module, **kwargs: Any) -> GraphedModule:
        """Graph ``module``'s forward from now on (an instance attribute; the class is untouched)."""
        graphed = cls(module, **kwargs)
        module.forward = graphed
        return graphed

    def uninstall(self) -> None:
        """Give ``module`` its own forward back and free the graphs. The params keep the grads
        they hold (the kept tensors, as an eager run leaves its last grads)."""
        if self.module.__dict__.get("forward") is self:
            if self._own is None:
                del self.module.forward
            else:
                self.module.forward = self._own
        self._drop()

    def __deepcopy__(self, memo: dict) -> Any:
        # a deep copy of the module (an EMA, a checkpoint callback) gets the plain forward
        twin = memo.get(id(self.module))
        if twin is None:
            raise TypeError(f"{self._ledger.who}: copy the module, not its graphed forward")
        if self._own is not None:
            return copy.deepcopy(self._own, memo)
        return types.MethodType(type(self.module).forward, twin)

    # ---- a call ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "depth", 0) or not self.module.training or not torch.is_grad_enabled():
            return self._original(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        structure = flatten((args, kwargs), tensors)
        if not tensors or not all(t.is_cuda for t in tensors) or torch.cuda.is_current_stream_capturing():
            return self._original(*args, **kwargs)
        ledger = self._ledger
        if self._busy():
            ledger.ran_eagerly()
            return self._original(*args, **kwargs)
        if self._signature() != self._layout:
            self._drop()
            self._layout = self._signature()
        device = tensors[0].device
        ledger.device = device
        reduce = self._sync is not None and self._sync.active()
        key = (structure, reduce, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
               tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors))
        try:
            hash(key)
        except TypeError as e:
            ledger.warn(f"an argument is not hashable ({e})")
            ledger.ran_eagerly()
            return self._original(*args, **kwargs)
        action, pair = ledger.lookup(key)
        if action is Action.CAPTURE:
            pair = self._capture(key, structure, tensors, device, reduce)
        if pair is not None:
            return self._replay(pair, tensors)
        ledger.ran_eagerly()
        if action is not Action.EAGER:
            return self._original(*args, **kwargs)
        with _Inside():
            return ledger.first_sighting(key, device, "the forward", self._original, *args, **kwargs)

    def _replay(self, pair: GraphPair, tensors: list[torch.Tensor]) -> Any:
        if self._anchor is None or self._anchor.device != tensors[0].device:
            self._anchor = torch.empty(0, device=tensors[0].device, requires_grad=True)
        pending = PendingBackward() if pair.grad_index else None
        outs = PairReplay.apply(self._ledger.who, pair, pending, self._anchor, *tensors)
        if pending is not None:
            self._pending = weakref.ref(pending)
        self._ledger.replayed()
        return unflatten(pair.structure, iter(outs))

    def _busy(self) -> bool:
        pending = self._pending
        return pending is not None and pending() is not None

    # ---- capture ---------------------------------------------------------------------------------
    def _capture(self, key: Hashable, structure: Hashable, tensors: list[torch.Tensor],
                 device: torch.device, reduce: bool) -> GraphPair | None:
        """Capture the key's three graphs; on failure mark it eager and return None (no kernel of
        the forward ran)."""
        ledger = self._ledger
        ledger.before_capture(device)
        # what earlier eager steps left cached would sit beside the graphs' pool, which cannot use
        # it, for as long as it takes the caller's stream to reuse it: give it back first
        torch.cuda.empty_cache()
        side, current = side_stream(device), torch.cuda.current_stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side), _Inside():
                # made on the capture stream: autograd ties a leaf's grad to the stream it was made on
                static = [torch.empty_like(x, memory_format=torch.preserve_format) for x in tensors]
                for s, x in zip(static, tensors):
                    s.copy_(x.detach())  # a leaf: the backward must not reach into the caller's graph
                    s.requires_grad_(x.requires_grad)
                args, kwargs = unflatten(structure, iter(static))
                pair = self._capture_on_side(args, kwargs, static, current, reduce)
        except Exception as e:
            ledger.capture_failed(key, e)
            return None
        finally:
            current.wait_stream(side)
        ledger.store(key, pair)
        # the first sighting's eager step left its memory cached for the capture stream, where the
        # caller's stream cannot reuse it: give it back (once per capture)
        torch.cuda.empty_cache()
        for leaf in pair.reached:  # leaves outside the module: their moving drops the graphs too
            if not any(leaf is t for t in self._watched):
                self._watched.append(leaf)
        self._layout = self._signature()
        return pair

    def _capture_on_side(self, args: tuple, kwargs: dict, static: list[torch.Tensor],
                         current: torch.cuda.Stream, reduce: bool) -> GraphPair:
        enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        pool = self._ledger.pool.handle()
        with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
            forward, out = captured(pool, lambda: self._original(*args, **kwargs))
        outputs: list[torch.Tensor] = []
        out_structure = flatten(out, outputs)
        del out
        grad_index = tuple(i for i, o in enumerate(outputs) if o.requires_grad)
        differentiable = [outputs[i] for i in grad_index]
        static_ids = {id(s) for s in static}
        reached = [t for t in reached_leaves(differentiable) if id(t) not in static_ids]
        with torch.cuda.stream(current):  # ordinary memory, outside the graphs' pool
            kept = [self._kept_for(t) for t in reached]
            grad_outputs = [torch.empty_like(o) for o in differentiable]
        wanted = [s for s in static if s.requires_grad]

        # autograd.grad, not backward(): no AccumulateGrad node runs in the capture (one made on
        # another stream before it, kept alive by a live graph, would join that stream to the
        # capture and break it), and the graph adds the grads into the kept tensors itself
        def backward(zero: bool) -> tuple[list[bool], tuple[torch.Tensor | None, ...]]:
            launch = self._sync.start(reached, kept, zero) if reduce else None
            handled = frozenset() if launch is None else launch.positions
            hooks = [reached[i].register_hook(functools.partial(_hand_over, launch, i)) for i in handled]
            try:
                grads = torch.autograd.grad(differentiable, reached + wanted, grad_outputs,
                                            retain_graph=True, allow_unused=True)
            finally:
                for hook in hooks:
                    hook.remove()
            if launch is not None:
                launch.finish()
                synced.append(True)
            written = [(k, g) for i, (k, g) in enumerate(zip(kept, grads))
                       if g is not None and i not in handled]
            if written:
                into, values = map(list, zip(*written))
                (torch._foreach_copy_ if zero else torch._foreach_add_)(into, values)
            got = iter(grads[len(reached):])
            return [g is not None for g in grads[:len(reached)]], tuple(
                next(got) if s.requires_grad else None for s in static)

        add = zero = None
        synced: list[bool] = []
        used = [False] * len(reached)
        input_grads_add = input_grads_zero = (None,) * len(static)
        if differentiable:
            add, (used, input_grads_add) = captured(pool, backward, False)
            zero, (_, input_grads_zero) = captured(pool, backward, True)
        written = [(t, k) for t, k, u in zip(reached, kept, used) if u]
        return GraphPair(forward=forward, backward_add=add, backward_zero=zero, inputs=tuple(static),
                         outputs=tuple(o.detach() for o in outputs), structure=out_structure,
                         grad_index=grad_index, grad_outputs=tuple(grad_outputs),
                         input_grads_add=input_grads_add, input_grads_zero=input_grads_zero,
                         reached=tuple(t for t, _ in written), kept=tuple(k for _, k in written),
                         saved=tuple(differentiable),
                         on_backward=self._sync.replayed if synced else None)

    def _kept_for(self, leaf: torch.Tensor) -> torch.Tensor:
        kept = self._kept.get(id(leaf))
        if kept is None and self._grads is not None:
            kept = self._grads(leaf)
        if kept is None or kept.shape != leaf.shape or kept.dtype != leaf.dtype or kept.device != leaf.device:
            kept = torch.zeros_like(leaf, memory_format=torch.preserve_format)
        self._kept[id(leaf)] = kept
        return kept

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _signature(self) -> tuple:
        return tuple((t.data_ptr(), t.requires_grad) for t in self._watched)

    def _drop(self) -> None:
        """Forget every graph and kept grad (the params keep what their ``.grad`` holds)."""
        self._ledger.clear()
        self._kept = {}
        self._pending = None


__all__ = ["GraphedModule"]
