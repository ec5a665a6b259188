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
copies the incoming grads into the static buffers and replays a backward graph.

**Grads.** A graph writes to fixed addresses, so each param the backward gives a grad keeps one
grad tensor (its "kept" grad). Before a backward replay every such param's ``.grad`` becomes its
kept tensor again, holding what autograd would have added to: nothing for a grad that was None
(after ``zero_grad(set_to_none=True)``: when all are None the graph writes the grads instead of
adding them), a copy of another tensor a user put there, or the kept tensor as it is (gradient
accumulation). Params that get no grad keep theirs as it is (None stays None). The add is its
own multi-tensor kernel in the graph, as autograd's AccumulateGrad adds per param; modules that
fuse it into their weight-grad kernel eagerly (FusedMLP) round the sum once less there.

**Memory.** The graphs allocate from a :class:`GraphPool`, the module's own or one shared with the
other graphed modules of the step (what keeps sharing safe is in its docstring). The allocator's
cache is emptied before a capture, so that blocks cached by earlier eager steps do not sit beside
the pool.

**Eager calls.** With the reason in :attr:`GraphedModule.reasons` and one warning: a host sync in
the forward, a capture that fails, an argument that is neither a tensor nor hashable. Without one:
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
import dataclasses
import threading
import types
import warnings
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from trainfuse._runtime import compat
from trainfuse.graphs.cache import Action, ShapeCache
from trainfuse.graphs.pool import GraphPool
from trainfuse.graphs.step import StepStats
from trainfuse.graphs.sync import captured, side_stream, watching_syncs
from trainfuse.graphs.tree import flatten, reached_leaves, unflatten

_state = threading.local()  # .depth: graphed calls and captures running in this thread


class _Inside:
    """Marks a graphed call in progress: graphed modules called inside it run their forward as is."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1


@dataclasses.dataclass(eq=False)  # hashed by identity: a GraphPool holds it in a WeakSet
class _Pair:
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


class _Pending:
    """Alive while a replay's backward is still to run (held by the autograd node)."""

    __slots__ = ("__weakref__",)


class _Replay(torch.autograd.Function):
    """The forward graph's replay as an autograd op; its backward replays a backward graph."""

    @staticmethod
    def forward(ctx, owner: GraphedModule, pair: _Pair, anchor: torch.Tensor, *tensors: torch.Tensor):
        for static, x in zip(pair.inputs, tensors):
            static.copy_(x)
        pair.forward.replay()
        outs = tuple(o.clone() for o in pair.outputs)
        fixed = [o for i, o in enumerate(outs) if i not in pair.grad_index]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        ctx.set_materialize_grads(False)
        ctx.owner, ctx.pair = owner, pair
        if pair.grad_index:
            ctx.pending = owner._started()
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        owner = ctx.owner
        if torch.is_grad_enabled():
            raise RuntimeError(f"GraphedModule {owner.name!r}: a replayed backward cannot build a graph "
                               "(create_graph=True); run the module without graphs for double backward")
        if compat.will_engine_execute_node(ctx.next_functions[0][0]) is not True:
            raise RuntimeError(f"GraphedModule {owner.name!r}: autograd.grad() or backward(inputs=...) "
                               "through a replay; its backward writes the params' .grad as backward() "
                               "does, so run the module without graphs for these calls")
        return (None, None, None, *owner._backward(ctx.pair, grads, ctx.needs_input_grad[3:]))


class GraphedModule:
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
    """

    def __init__(self, module: nn.Module, *, max_graphs: int = 8, name: str = "module",
                 pool: GraphPool | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"GraphedModule: module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.name = name
        self._own = module.__dict__.get("forward")  # an instance-level forward the user set, if any
        self._original = module.forward
        self._cache: ShapeCache[_Pair] = ShapeCache(max_graphs)
        self._max_graphs = max_graphs
        self._pool = GraphPool() if pool is None else pool
        self._stats = StepStats()
        self._evicted = 0
        self._warned = False
        self._pending: weakref.ref | None = None
        self._anchor: torch.Tensor | None = None
        self._kept: dict[int, torch.Tensor] = {}
        self._watched = list(module.parameters()) + list(module.buffers())
        self._layout = self._signature()
        self._device: torch.device | None = None
        self._peak_before_capture: int | None = None

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
            raise TypeError(f"GraphedModule {self.name!r}: copy the module, not its graphed forward")
        if self._own is not None:
            return copy.deepcopy(self._own, memo)
        return types.MethodType(type(self.module).forward, twin)

    @property
    def stats(self) -> StepStats:
        """Counts of eager calls, replays, captures, failed captures and evictions (training calls)."""
        return dataclasses.replace(self._stats, evictions=self._evicted + self._cache.evictions)

    @property
    def reasons(self) -> dict[Hashable, str]:
        """The keys that run eagerly because of a sync or a failed capture, with why."""
        return self._cache.reasons

    def memory_report(self) -> dict[str, int | None]:
        """``peak_before_capture``: ``torch.cuda.max_memory_allocated`` right before the first capture
        (None until then); ``peak_now``: the same now (None before a CUDA call)."""
        now = None if self._device is None else torch.cuda.max_memory_allocated(self._device)
        return {"peak_before_capture": self._peak_before_capture, "peak_now": now}

    # ---- a call ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "depth", 0) or not self.module.training or not torch.is_grad_enabled():
            return self._original(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        structure = flatten((args, kwargs), tensors)
        if not tensors or not all(t.is_cuda for t in tensors) or torch.cuda.is_current_stream_capturing():
            return self._original(*args, **kwargs)
        if self._busy():
            self._stats.eager += 1
            return self._original(*args, **kwargs)
        if self._signature() != self._layout:
            self._drop()
            self._layout = self._signature()
        device = tensors[0].device
        self._device = device
        key = (structure, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
               tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors))
        try:
            hash(key)
        except TypeError as e:
            self._warn(f"an argument is not hashable ({e})")
            self._stats.eager += 1
            return self._original(*args, **kwargs)
        action, pair = self._cache.lookup(key)
        if action is Action.CAPTURE:
            pair = self._capture(key, structure, tensors, device)
        if pair is not None:
            return self._replay(pair, tensors)
        self._stats.eager += 1
        if action is not Action.EAGER:
            return self._original(*args, **kwargs)
        with _Inside():
            try:
                out, sync = watching_syncs(device, self._original, *args, **kwargs)
            except BaseException:
                self._cache.forget(key)  # a call that raised is no sighting
                raise
        if sync is not None:
            self._fail(key, RuntimeError(f"the forward synchronizes with the host: {sync}"))
        return out

    def _replay(self, pair: _Pair, tensors: list[torch.Tensor]) -> Any:
        if self._anchor is None or self._anchor.device != tensors[0].device:
            self._anchor = torch.empty(0, device=tensors[0].device, requires_grad=True)
        outs = _Replay.apply(self, pair, self._anchor, *tensors)
        self._stats.replays += 1
        return unflatten(pair.structure, iter(outs))

    def _busy(self) -> bool:
        pending = self._pending
        return pending is not None and pending() is not None

    def _started(self) -> _Pending:
        token = _Pending()
        self._pending = weakref.ref(token)
        return token

    def _backward(self, pair: _Pair, grads: tuple, needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
        for static, i in zip(pair.grad_outputs, pair.grad_index):
            g = grads[i]
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        none, foreign = [], []
        for p, kept in zip(pair.reached, pair.kept):
            g = p.grad
            if g is kept:
                continue
            if g is None:
                none.append(kept)
            else:
                foreign.append((kept, g))
            p.grad = kept
        if len(none) == len(pair.kept):
            pair.backward_zero.replay()
            input_grads = pair.input_grads_zero
        else:
            if none:
                torch._foreach_zero_(none)
            for kept, g in foreign:
                kept.copy_(g)
            pair.backward_add.replay()
            input_grads = pair.input_grads_add
        self._pending = None
        return [g.clone() if need and g is not None else None for g, need in zip(input_grads, needs)]

    # ---- capture ---------------------------------------------------------------------------------
    def _capture(self, key: Hashable, structure: Hashable, tensors: list[torch.Tensor],
                 device: torch.device) -> _Pair | None:
        """Capture the key's three graphs; on failure mark it eager and return None (no kernel of
        the forward ran)."""
        if self._peak_before_capture is None:
            self._peak_before_capture = torch.cuda.max_memory_allocated(device)
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
                pair = self._capture_on_side(args, kwargs, static, current)
        except Exception as e:
            self._pool.renew()  # later captures start a fresh pool; the graphs made stay valid
            self._fail(key, e)
            return None
        finally:
            current.wait_stream(side)
        self._cache.store(key, pair)
        self._stats.captures += 1
        # the first sighting's eager step left its memory cached for the capture stream, where the
        # caller's stream cannot reuse it: give it back (once per capture)
        torch.cuda.empty_cache()
        for leaf in pair.reached:  # leaves outside the module: their moving drops the graphs too
            if not any(leaf is t for t in self._watched):
                self._watched.append(leaf)
        self._layout = self._signature()
        return pair

    def _capture_on_side(self, args: tuple, kwargs: dict, static: list[torch.Tensor],
                         current: torch.cuda.Stream) -> _Pair:
        enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        pool = self._pool.handle()
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
            grads = torch.autograd.grad(differentiable, reached + wanted, grad_outputs,
                                        retain_graph=True, allow_unused=True)
            written = [(k, g) for k, g in zip(kept, grads) if g is not None]
            if written:
                into, values = map(list, zip(*written))
                (torch._foreach_copy_ if zero else torch._foreach_add_)(into, values)
            got = iter(grads[len(reached):])
            return [g is not None for g in grads[:len(reached)]], tuple(
                next(got) if s.requires_grad else None for s in static)

        add = zero = None
        used = [False] * len(reached)
        input_grads_add = input_grads_zero = (None,) * len(static)
        if differentiable:
            add, (used, input_grads_add) = captured(pool, backward, False)
            zero, (_, input_grads_zero) = captured(pool, backward, True)
        written = [(t, k) for t, k, u in zip(reached, kept, used) if u]
        pair = _Pair(forward, add, zero, tuple(static), tuple(o.detach() for o in outputs), out_structure,
                     grad_index, tuple(grad_outputs), input_grads_add, input_grads_zero,
                     tuple(t for t, _ in written), tuple(k for _, k in written), tuple(differentiable))
        self._pool.hold(pair)
        return pair

    def _kept_for(self, leaf: torch.Tensor) -> torch.Tensor:
        kept = self._kept.get(id(leaf))
        if kept is None or kept.shape != leaf.shape or kept.dtype != leaf.dtype or kept.device != leaf.device:
            kept = self._kept[id(leaf)] = torch.zeros_like(leaf, memory_format=torch.preserve_format)
        return kept

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _signature(self) -> tuple:
        return tuple((t.data_ptr(), t.requires_grad) for t in self._watched)

    def _drop(self) -> None:
        """Forget every graph and kept grad (the params keep what their ``.grad`` holds)."""
        self._evicted += self._cache.evictions
        self._cache = ShapeCache(self._max_graphs)
        self._kept = {}
        self._pending = None

    def _fail(self, key: Hashable, error: BaseException) -> None:
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"
        self._cache.fail(key, reason)
        self._stats.fallbacks += 1
        self._warn(reason)

    def _warn(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"GraphedModule {self.name!r}: could not capture a CUDA graph, so these calls run "
                          f"eagerly ({reason}); later failures are listed in .reasons", RuntimeWarning,
                          stacklevel=4)


__all__ = ["GraphedModule"]
