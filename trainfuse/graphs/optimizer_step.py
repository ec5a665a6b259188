"""The optimizer phase of an iteration replayed from one CUDA graph.

On a graph-safe fused optimizer (``graph_safe = True``) every value the phase's launches read is
in device memory: the tables, the hyperparameters, the EMA weight (written by
:meth:`~trainfuse.optim.FusedOptimizer.prepare_step`), GradScaler's scale and growth tracker (read
and updated by the statistics pass). So ``scaler.step_and_update(optimizer)`` (unscale, inf check,
clip, update, EMA, scale update: two launches) can be captured once and replayed.
:class:`GraphedOptimizerStep` runs it eagerly while what a graph would hold keeps changing (the
first call builds the tables), captures it once two eager calls in a row left it unchanged (the
kernels of a steady step compiled and loaded: nothing may compile or load inside a capture), and
replays it after that.

What a graph holds, compared before every replay: the engine's tables (``plans.generation``: a
param group, the state, a param's storage), the params' and grads' addresses, the scaler's two
tensors and the attached EMA's tensor list. Any difference drops the graph; that call runs
eagerly, and a later one captures again. The graph keeps every tensor it addresses alive (the
tables and their tensors through the engine, which changes ``generation`` before freeing any; the
grads and the scaler's tensors here).

Off CUDA, and where a capture fails, every call runs eagerly (after ``prepare_step``).
"""

from __future__ import annotations

import operator
import warnings

import torch

from trainfuse.amp import GradScaler
from trainfuse.graphs.pool import GraphPool
from trainfuse.graphs.sync import captured, side_stream
from trainfuse.optim import FusedOptimizer

_data_ptr = torch.Tensor.data_ptr
_grad = operator.attrgetter("grad")


class GraphedOptimizerStep:
    """``scaler.step_and_update(optimizer)``, replayed from a CUDA graph where it holds.

    Args:
        optimizer: a fused optimizer; made graph-safe for this object's life (:meth:`close`
            undoes it).
        scaler: trainfuse's GradScaler, enabled.

    Attributes:
        eager, captures, replays: calls run eagerly, graphs captured, replays.
    """

    def __init__(self, optimizer: FusedOptimizer, scaler: GradScaler) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError(f"GraphedOptimizerStep: optimizer must be a trainfuse fused optimizer, got "
                            f"{type(optimizer).__name__}")
        if not isinstance(scaler, GradScaler) or not scaler.is_enabled():
            raise TypeError("GraphedOptimizerStep: scaler must be an enabled trainfuse.amp.GradScaler, got "
                            f"{type(scaler).__name__}")
        self.optimizer, self.scaler = optimizer, scaler
        optimizer.graph_safe = True
        self._graph: torch.cuda.CUDAGraph | None = None
        self._held: tuple | None = None  # what the graph was captured over (and keeps alive)
        self._seen: tuple | None = None  # what the last eager call left
        self._steady = 0  # eager calls in a row that found what the one before left
        self._failed = False
        self._pool = GraphPool()
        self.eager = self.captures = self.replays = 0

    def __call__(self) -> None:
        """One optimizer phase: ``prepare_step()``, then the replay, a capture and replay, or the
        eager ``step_and_update``."""
        opt = self.optimizer
        opt.prepare_step()
        if self._graph is not None:
            if self._holds():
                self._graph.replay()
                self.replays += 1
                return
            self._drop()  # something it holds changed: run eagerly, capture later
        now = self._snapshot()
        device = opt.engine.plans.index.device
        self._steady = self._steady + 1 if now == self._seen else 0
        if (not self._failed and self._steady >= 2 and device is not None and device.type == "cuda"
                and self._capture(device, now)):
            return
        self._eager()

    def _eager(self) -> None:
        self.scaler.step_and_update(self.optimizer)
        self.eager += 1
        self._seen = self._snapshot()

    def _capture(self, device: torch.device, now: tuple) -> bool:
        """Capture this call's phase on the side stream and replay it; False (nothing ran) where
        the capture failed."""
        torch.cuda.synchronize(device)  # as torch.cuda.graph does: nothing in flight joins the capture
        side, current = side_stream(device), torch.cuda.current_stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph, done = captured(self._pool.handle(), self._phase)
            if not done:
                raise RuntimeError("step_and_update took torch's two calls (not the fused step)")
        except Exception as e:
            self._failed = True
            self._pool.renew()
            warnings.warn(f"GraphedOptimizerStep: the optimizer phase runs eagerly from now on; its capture "
                          f"failed: {e}", RuntimeWarning, stacklevel=3)
            return False
        finally:
            current.wait_stream(side)
        self._pool.hold(self)
        scale, tracker = self.scaler.device_state()
        grads = [p.grad for p in self.optimizer.engine.plans.index.params]
        self._graph, self._held = graph, (now, scale, tracker, grads, self.optimizer.ema_tensors())
        self.captures += 1
        graph.replay()
        self.replays += 1
        return True

    def _phase(self) -> bool:
        """The captured work: the fused ``step_and_update`` only (True when it ran)."""
        fused = self.scaler.fused_update(self.optimizer)
        return fused is not None and self.optimizer.scaled_step(*fused)

    def _holds(self) -> bool:
        """Whether the graph still holds: :meth:`_snapshot`'s comparison, the cheap way (identities
        and one tuple of the params' addresses: this runs before every replay)."""
        now, scale, tracker, grads, ema = self._held
        opt, scaler = self.optimizer, self.scaler
        params = opt.engine.plans.index.params
        held_scale, held_tracker = scaler.device_state()
        return (opt.engine.plans.generation == now[0] and held_scale is scale and held_tracker is tracker
                and opt.ema_tensors() is ema and tuple(map(_data_ptr, params)) == now[1]
                and all(map(operator.is_, map(_grad, params), grads))
                and (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
                == now[6:])

    def _snapshot(self) -> tuple:
        """What a graph captured now would hold: the tables' generation, the params' and grads'
        addresses, the scaler's tensors and the EMA's tensor list (by identity), the scaler's
        factors and interval (constants of the launch)."""
        opt = self.optimizer
        params = opt.engine.plans.index.params
        scale, tracker = self.scaler.device_state()
        grads = tuple(-1 if p.grad is None else p.grad.data_ptr() for p in params)
        scaler = self.scaler
        return (opt.engine.plans.generation, tuple(map(_data_ptr, params)), grads, id(scale), id(tracker),
                id(opt.ema_tensors()), scaler.get_growth_factor(), scaler.get_backoff_factor(),
                scaler.get_growth_interval())

    def _drop(self) -> None:
        self._graph = self._held = None
        self._pool.renew()  # torch cannot capture again into a pool whose graphs were all freed

    def close(self) -> None:
        """Drop the graph; the optimizer steps the usual way again."""
        self._drop()
        self._seen = None
        self.optimizer.graph_safe = False


__all__ = ["GraphedOptimizerStep"]
