"""The optimizer phase of an iteration replayed from one CUDA graph.

On a graph-safe fused optimizer (its class declares ``capturable``; ``set_graph_safe(True)``)
every value the phase's launches read is in device memory: the tables, the hyperparameters, the
EMA weight (written by :meth:`~trainfuse.optim.FusedOptimizer.prepare_step`), GradScaler's scale
and growth tracker (read and updated by the statistics pass). So
``scaler.step_and_update(optimizer)`` (unscale, inf check, clip, update, EMA, scale update: two
launches) can be captured once and replayed; without a scaler (bf16 or float32 training), the
optimizer's ``fused_step()`` (clip, update, EMA).
:class:`GraphedOptimizerStep` runs it eagerly while what a graph would hold keeps changing (the
first call builds the tables), captures it once two eager calls in a row left it unchanged (the
kernels of a steady step compiled and loaded: nothing may compile or load inside a capture), and
replays it after that.

What a graph holds (:class:`_Snapshot`, :class:`_Held`), compared by name before every replay: the
optimizer's tables (``optimizer.capture_view().generation``: a param group, the state, a param's
storage), the params' and grads' addresses, the scaler's two tensors and constants, and the
attached EMA's tensor list. Any difference drops the graph; that call runs eagerly, and a later
one captures again. The graph keeps every tensor it addresses alive (the tables and their tensors
through the optimizer, whose generation changes before it frees any; the grads and the scaler's
tensors here).

A training step that is itself captured can run the phase inside its own graph instead, after
its backward (:meth:`GraphedOptimizerStep.ready_to_fold`, :meth:`~GraphedOptimizerStep.fold_holds`,
:meth:`~GraphedOptimizerStep.inside`): the phase then costs the host only ``prepare_step``.

Off CUDA, and where a capture fails, every call runs eagerly (after ``prepare_step``).
"""

from __future__ import annotations

import dataclasses
import operator
import warnings

import torch

from trainfuse.amp import GradScaler
from trainfuse.graphs.pool import GraphPool
from trainfuse.graphs.sync import captured, side_stream
from trainfuse.optim import FusedOptimizer
from trainfuse.optim.plans import CaptureView

_data_ptr = torch.Tensor.data_ptr
_grad = operator.attrgetter("grad")


@dataclasses.dataclass(frozen=True, slots=True)
class _Snapshot:
    """What a graph of the phase captured now would hold, by value: two eager calls that leave
    equal snapshots make the phase steady.

    Attributes:
        generation: the optimizer's tables (``capture_view().generation``).
        param_addresses: the params' addresses, in table order.
        grad_addresses: their grads' addresses (-1 for a param without a grad).
        scale_id, tracker_id: the scaler's scale and growth tracker tensors, by identity.
        ema_id: the attached EMA's tensor list (``optimizer.ema_tensors()``), by identity.
        growth_factor, backoff_factor, growth_interval: the scaler's constants, arguments of the
            captured launch.
    """

    generation: int
    param_addresses: tuple[int, ...]
    grad_addresses: tuple[int, ...]
    scale_id: int
    tracker_id: int
    ema_id: int
    growth_factor: float
    backoff_factor: float
    growth_interval: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Held:
    """What captured graphs hold: their :class:`_Snapshot` and the objects it names by identity,
    kept alive here (the graphs address the grads and the scaler's tensors)."""

    snapshot: _Snapshot
    scale: torch.Tensor | None
    tracker: torch.Tensor | None
    grads: list[torch.Tensor | None]
    ema: list[torch.Tensor] | None


class GraphedOptimizerStep:
    """``scaler.step_and_update(optimizer)`` (or without a scaler ``optimizer.step()``), replayed
    from a CUDA graph where it holds.

    Args:
        optimizer: a fused optimizer whose class declares ``capturable``; made graph-safe
            (``set_graph_safe``) for this object's life (:meth:`close` undoes it).
        scaler: trainfuse's GradScaler, enabled; or None where the grads are not scaled (the
            graphs then capture ``optimizer.fused_step()``).

    Attributes:
        eager, captures, replays: calls run eagerly, graphs captured, replays.
        folded: phases run inside a training step's graphs (:meth:`inside`).
    """

    def __init__(self, optimizer: FusedOptimizer, scaler: GradScaler | None) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError(f"GraphedOptimizerStep: optimizer must be a trainfuse fused optimizer, got "
                            f"{type(optimizer).__name__}")
        if not optimizer.capturable:
            name = type(optimizer).__name__
            raise TypeError(f"GraphedOptimizerStep: optimizer must declare capturable steps; {name}'s "
                            f"cannot be captured in a CUDA graph ({name}.capturable is False)")
        if scaler is not None and (not isinstance(scaler, GradScaler) or not scaler.is_enabled()):
            got = "a disabled GradScaler" if isinstance(scaler, GradScaler) else type(scaler).__name__
            raise TypeError("GraphedOptimizerStep: scaler must be an enabled trainfuse.amp.GradScaler or "
                            f"None, got {got}")
        self.optimizer, self.scaler = optimizer, scaler
        optimizer.set_graph_safe(True)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._held: _Held | None = None  # what the graph was captured over (and keeps alive)
        self._seen: _Snapshot | None = None  # what the last eager call left
        self._steady = 0  # eager calls in a row that found what the one before left
        self._failed = False
        self._pool = GraphPool()
        self._fold_held: _Held | None = None  # what the step graphs that run the phase hold
        self.eager = self.captures = self.replays = self.folded = 0

    def __call__(self) -> None:
        """One optimizer phase: ``prepare_step()``, then the replay, a capture and replay, or the
        eager ``step_and_update`` (without a scaler, ``step``)."""
        self.optimizer.prepare_step()
        self.run_prepared()

    def run_prepared(self) -> None:
        """The phase after its ``prepare_step()``: the replay, a capture and replay, or eager."""
        opt = self.optimizer
        if self._graph is not None:
            if self._holds():
                self._graph.replay()
                self.replays += 1
                return
            self._drop()  # something it holds changed: run eagerly, capture later
        view = opt.capture_view()
        now = self._snapshot(view)
        device = view.device
        self._steady = self._steady + 1 if now == self._seen else 0
        if (not self._failed and self._steady >= 2 and device is not None and device.type == "cuda"
                and self._capture(device)):
            return
        self._eager()

    # ---- inside a training step's graph ----------------------------------------------------------
    def ready_to_fold(self) -> bool:
        """Whether the next phase may run inside a captured training step (:meth:`inside`): on
        CUDA, no capture of the phase failed, and it has run steadily (two eager calls in a row
        found what the one before left, or its own graph holds): the kernels of a steady step are
        compiled and loaded, as a capture needs."""
        if self._failed or (self._steady < 2 and self._graph is None):
            return False
        device = self.optimizer.capture_view().device  # (the tables' device: the first step has run)
        return device is not None and device.type == "cuda"

    def fold_holds(self) -> bool:
        """Before a training step that runs the phase inside (eagerly, captured or replayed):
        True where the step's graphs that ran it were made over what is there now (the first time,
        this is taken as what they hold). False: the tables, a param, a grad, the scaler or the EMA
        changed since, and the caller must drop those graphs; the phase then runs on its own (eager)
        until it is steady again."""
        if self._fold_held is None:
            self._fold_held = self._holding()
            return True
        if self._holds(self._fold_held):
            return True
        self._fold_held = self._seen = None
        self._steady = 0
        self._drop()
        return False

    def prepare(self) -> None:
        """The phase's host part (``prepare_step``), before a step that runs :meth:`inside`
        (eagerly, captured or replayed; counted in :attr:`folded`)."""
        self.optimizer.prepare_step()
        self.folded += 1

    def inside(self) -> None:
        """The phase's launches, inside a training step's ``fn`` (run eagerly or captured), after
        :meth:`prepare`."""
        if not self._phase():
            raise RuntimeError("GraphedOptimizerStep.inside: the step did not run as the fused launches "
                               "(step_and_update took torch's two calls, or fused_step could not run)")

    def _holding(self) -> _Held:
        """What a graph captured now holds (and keeps alive): see :meth:`_holds`."""
        view = self.optimizer.capture_view()
        scale, tracker = self._device_state()
        grads = [p.grad for p in view.params]
        return _Held(self._snapshot(view), scale, tracker, grads, self.optimizer.ema_tensors())

    def _eager(self) -> None:
        if self.scaler is None:  # the class's step: a client may have put this object's call on the instance
            type(self.optimizer).step(self.optimizer)
        else:
            self.scaler.step_and_update(self.optimizer)
        self.eager += 1
        self._seen = self._snapshot(self.optimizer.capture_view())

    def _capture(self, device: torch.device) -> bool:
        """Capture this call's phase on the side stream and replay it; False (nothing ran) where
        the capture failed."""
        torch.cuda.synchronize(device)  # as torch.cuda.graph does: nothing in flight joins the capture
        side, current = side_stream(device), torch.cuda.current_stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph, done = captured(self._pool.handle(), self._phase)
            if not done:
                raise RuntimeError("the step did not run as the fused launches (step_and_update took torch's "
                                   "two calls, or fused_step could not run)")
        except Exception as e:
            self._failed = True
            self._pool.renew()
            warnings.warn(f"GraphedOptimizerStep: the optimizer phase runs eagerly from now on; its capture "
                          f"failed: {e}", RuntimeWarning, stacklevel=3)
            return False
        finally:
            current.wait_stream(side)
        self._pool.hold(self)
        self._graph, self._held = graph, self._holding()
        self.captures += 1
        graph.replay()
        self.replays += 1
        return True

    def _phase(self) -> bool:
        """The captured work: the fused ``step_and_update``, or without a scaler ``fused_step``,
        only (True when it ran)."""
        if self.scaler is None:
            return self.optimizer.fused_step()
        fused = self.scaler.fused_update(self.optimizer)
        return fused is not None and self.optimizer.scaled_step(*fused)

    def _holds(self, held: _Held | None = None) -> bool:
        """Whether the graph (or the graphs that hold ``held``) still holds: :meth:`_snapshot`'s
        comparison, the cheap way (identities and one tuple of the params' addresses: this runs
        before every replay)."""
        held = self._held if held is None else held
        was = held.snapshot
        opt = self.optimizer
        view = opt.capture_view()
        params = view.params
        scale, tracker = self._device_state()
        return (view.generation == was.generation and scale is held.scale and tracker is held.tracker
                and opt.ema_tensors() is held.ema and tuple(map(_data_ptr, params)) == was.param_addresses
                and all(map(operator.is_, map(_grad, params), held.grads))
                and self._constants() == (was.growth_factor, was.backoff_factor, was.growth_interval))

    def _device_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scaler's scale and growth tracker (None, None without a scaler)."""
        return (None, None) if self.scaler is None else self.scaler.device_state()

    def _constants(self) -> tuple[float, float, int]:
        """The scaler's growth factor, backoff factor and growth interval (zeros without one)."""
        scaler = self.scaler
        if scaler is None:
            return 0.0, 0.0, 0
        return scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()

    def _snapshot(self, view: CaptureView) -> _Snapshot:
        """What a graph captured now would hold, ``view`` the optimizer's ``capture_view()``."""
        params = view.params
        scale, tracker = self._device_state()
        growth, backoff, interval = self._constants()
        return _Snapshot(
            generation=view.generation,
            param_addresses=tuple(map(_data_ptr, params)),
            grad_addresses=tuple(-1 if p.grad is None else p.grad.data_ptr() for p in params),
            scale_id=id(scale), tracker_id=id(tracker), ema_id=id(self.optimizer.ema_tensors()),
            growth_factor=growth, backoff_factor=backoff, growth_interval=interval)

    def _drop(self) -> None:
        self._graph = self._held = None
        self._pool.renew()  # torch cannot capture again into a pool whose graphs were all freed

    def close(self) -> None:
        """Drop the graph; the optimizer steps the usual way again."""
        self._drop()
        self._seen = self._fold_held = None
        self.optimizer.set_graph_safe(False)


__all__ = ["GraphedOptimizerStep"]
