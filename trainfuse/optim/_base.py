"""What every fused optimizer shares: torch.optim's contract on top of the step driver.

A subclass supplies the per-param state (:meth:`state_keys`, :meth:`init_state`,
:meth:`step_tensor`), its per-group hyperparameters as a fixed-width row (:meth:`hparams_row`,
checked by :meth:`validate_group`), its per-chunk Triton math (``chunk_fn``, written with
``trainfuse._multi_tensor.kernels`` and run by ``kernels.update_kernel``; ``wide16``) and the
torch reference step (:meth:`torch_group_step`). :class:`FusedOptimizer` turns them into what the
step driver (:class:`trainfuse.optim.engine.MultiTensorEngine`) needs of an optimizer, the
:class:`trainfuse.optim.contract.OptimizerClient` protocol; tables, caching, AMP, validation and
state_dict live here and in the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import Optimizer

from trainfuse._multi_tensor.tables import conform, same_layout
from trainfuse._runtime import compat
from trainfuse.optim.clip_settings import ClipSettings
from trainfuse.optim.engine import MultiTensorEngine
from trainfuse.optim.plans import CaptureView
from trainfuse.optim.tracked import ParamList, StateDict

# state key of the float32 master weight of a 16-bit param (saved in state_dict like any state)
MASTER_KEY = "master_param"


def scalar(value: Any, name: str) -> float | torch.Tensor:
    """A float, or a one-element tensor kept as a tensor (read on the device, never synced)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return value
    return float(value)


def _as_float(value: float | torch.Tensor) -> float:
    return float(value.detach().cpu()) if isinstance(value, torch.Tensor) else float(value)


class FusedOptimizer(ClipSettings, Optimizer):
    """Base class: a ``torch.optim.Optimizer`` whose step is one multi-tensor kernel launch.

    ``engine`` is its step driver (:class:`~trainfuse.optim.engine.MultiTensorEngine`, whose
    ``plans`` are the cached tables), rebuilt on copy and unpickle.
    """

    # Width of one group's row in the float64 hyperparameter table the kernel reads.
    HP_WIDTH = 8
    # The subclass's per-chunk update (a @triton.jit function, kernels.run's contract), and whether
    # its 16-bit rows take blocks twice as long.
    chunk_fn: Any
    wide16: bool
    # Set once the constructor has validated the first groups; later groups are checked on add.
    _hparams_checked = False
    # The process group whose ranks each hold a shard of the params (FSDP's flat shards): set it,
    # and the clipping norm of ``max_grad_norm`` and GradScaler's inf check cover every rank's
    # grads (one all-reduce on the device, no host sync). DTensor params (FSDP2) need none: their
    # mesh names the group. Not carried by copies or pickles.
    shard_group: Any = None
    # Whether a step of this class can be captured in a CUDA graph and replayed as later steps:
    # every value its launches read can live in device memory (set_graph_safe). torch's optimizers
    # state the same as ``capturable``; a client reads it here and keeps no list of classes. False
    # until a subclass declares otherwise.
    capturable: ClassVar[bool] = False
    # Graph-safe steps are on (set_graph_safe; read through the graph_safe property).
    _graph_safe = False

    def __init__(self, params, defaults: dict[str, Any], max_grad_norm: float | None = None,
                 max_grad_value: float | None = None):
        if max_grad_norm is not None and not float(max_grad_norm) >= 0.0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (expected a number >= 0)")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.max_grad_value = max_grad_value
        self.check_clipping()
        self.max_grad_value = None if max_grad_value is None else float(max_grad_value)
        # device -> (max_grad_value, the float32 tensor holding it) that the update kernel reads
        self._clip_values: dict[torch.device, tuple[float, torch.Tensor]] = {}
        self._ema = None
        self.ema_weight: float | None = None
        self.engine = MultiTensorEngine(self)
        super().__init__(params, defaults)
        self.track_mutations()
        self.check_hparams()

    # ---- torch.optim contract ----------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:  # a refused group must not stay behind in param_groups
            for p in self.param_groups[-1]["params"]:
                if p.is_complex():
                    raise ValueError(
                        f"{type(self).__name__}: complex params are not supported (shape "
                        f"{tuple(p.shape)}); view them as real with torch.view_as_real"
                    )
            if self._hparams_checked:
                self.check_hparams()
        except ValueError:
            self.param_groups.pop()
            raise
        self.param_groups[-1]["params"] = ParamList(self.param_groups[-1]["params"])
        self.engine.invalidate()

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict()``, with plain dicts as per-param states (``torch.load`` with
        ``weights_only=True`` takes nothing else)."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every floating state to its param's dtype; float32 masters (and the float32
        # states beside them) of a 16-bit param must come back at full precision
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        keep = {}
        for i, p in zip(ids, params):
            st = saved.get(i)
            if st is not None and torch.is_tensor(st.get(MASTER_KEY)):
                keep[p] = {k: v for k, v in st.items()
                           if k != "step" and torch.is_tensor(v) and v.is_floating_point()}
        super().load_state_dict(state_dict)
        for p, st in keep.items():
            for k, v in st.items():
                self.state[p][k] = v.to(device=p.device, dtype=torch.float32, copy=True)
        self.engine.invalidate()

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps defaults, state and param_groups; a copy must also clip, fold its EMA and
        # keep masters (those live in the groups and the state) exactly as this one does
        state = super().__getstate__()
        state["max_grad_norm"] = self.max_grad_norm
        state["max_grad_value"] = self.max_grad_value
        state["_ema"] = self._ema
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("max_grad_value", None)
        self._clip_values = {}
        self.__dict__.setdefault("_ema", None)
        self.__dict__.setdefault("ema_weight", None)
        self.engine = MultiTensorEngine(self)
        self.track_mutations()

    def track_mutations(self) -> None:
        """Make ``state`` a :class:`~trainfuse.optim.tracked.StateDict` and every group's
        ``params`` a :class:`~trainfuse.optim.tracked.ParamList` (same contents), so that the step
        driver sees any change to them in O(1) before it launches on its cached tables."""
        if type(self.state) is not StateDict:
            self.state = StateDict(self.state)
        for group in self.param_groups:
            if type(group["params"]) is not ParamList:
                group["params"] = ParamList(group["params"])

    def plan_key(self, group: dict[str, Any]) -> tuple:
        """What of ``group`` shapes the kernel's tables besides addresses: which state tensors a
        param carries (momentum, amsgrad) and whether it keeps a float32 master. A change rebuilds
        the tables before the next launch."""
        return self.state_keys(group), bool(group.get("master_weights"))

    # ---- gradient clipping, masters, EMA ------------------------------------------------------
    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm the last step clipped with (``max_grad_norm``): a device
        tensor, read without a host sync; None when no step has computed a norm (no
        ``max_grad_norm``, or no step yet)."""
        return self.engine.grad_norm()

    def refresh_hparams(self) -> None:
        """Write the groups' current hyperparameters (lr, momentum, betas, weight decay...) into
        the device table the update kernel reads, in place (a non-blocking copy, no sync).

        A step does this itself; a step replayed from a CUDA graph does not run the host code, so
        a caller that changes ``lr`` between replays (a scheduler, a warmup) calls this before each
        replay. The table keeps its address while the groups keep their number and layout."""
        self.engine.refresh_hparams()

    def check_grads(self, grad_scale: torch.Tensor) -> dict[torch.device, torch.Tensor] | None:
        """GradScaler's inf/NaN check of the scaled grads, done by the statistics pass the step
        runs anyway (which also takes the clipping norm when ``max_grad_norm`` is set): returns
        ``{device: found_inf}`` without a host sync, or None where the kernels do not run (params
        on several devices, the torch path): the caller then checks as torch does. The next
        :meth:`step` consumes the result; :meth:`discard_grad_check` drops it."""
        return self.engine.check_grads(grad_scale)

    def discard_grad_check(self) -> None:
        """Forget a :meth:`check_grads` result that no step consumed (the step raised), so the
        next step validates its grads again."""
        self.engine.forget_check()

    def attach_ema(self, ema) -> None:
        """Fold ``ema`` (a :class:`trainfuse.optim.FusedEMA` of the model these params belong to)
        into every step: the update kernel lerps each param's EMA toward the new weight while it
        has it in registers (+8 bytes per fp32 param), and the EMA's other tensors (buffers,
        params without a gradient) move in the same launch. ``ema.update(model)`` then does
        nothing: each ``step()`` counts one EMA update, also when GradScaler skips the step
        (ModelEMA updates after every optimizer step too). ``attach_ema(None)`` detaches."""
        if self._ema is not None:
            self._ema.attached = None
        if ema is not None:
            if getattr(ema, "attached", None) not in (None, self):
                raise ValueError(f"{type(self).__name__}.attach_ema: this EMA is attached to another "
                                 "optimizer")
            ema.attached = self
        self._ema = ema
        self.engine.invalidate()

    def ema_target(self, p: torch.Tensor) -> torch.Tensor | None:
        return None if self._ema is None else self._ema.target_of(p)

    def ema_pairs(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [] if self._ema is None else self._ema.pairs_on(device)

    def ema_tensors(self) -> list[torch.Tensor] | None:
        return None if self._ema is None else self._ema.tensors()

    def master_of(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        """The float32 master of a 16-bit ``p`` (created from ``p`` the first time, when the group
        asks for masters), or None."""
        state = self.state.get(p)
        master = None if state is None else state.get(MASTER_KEY)
        if master is None and group.get("master_weights") and p.dtype in (torch.bfloat16, torch.float16):
            master = p.detach().float().clone(memory_format=torch.preserve_format)
            self.state[p][MASTER_KEY] = master
        if master is not None and (master.device != p.device or master.dtype != torch.float32
                                   or not same_layout(master, p)):
            master = conform(master, p.detach().float())
            self.state[p][MASTER_KEY] = master
        return master

    def seed_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Keep ``value`` (float32) as ``p``'s master, before ``p`` is cast to 16 bits."""
        self.state[p][MASTER_KEY] = value.detach().float().clone(memory_format=torch.preserve_format)
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                group["master_weights"] = True
        self.engine.invalidate()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``set_to_none`` (the default) and no profiler running it
        skips torch's per-call profiler range and bookkeeping (a third of a small step's host time)."""
        if not set_to_none or compat.profiler_enabled():
            super().zero_grad(set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _keep_step_unwrapped(self) -> None:
        """Stands in for torch's ``Optimizer._patch_step_function`` (bound below,
        ``compat.STEP_PATCH_METHOD``): torch wraps every step in a profiler range plus a walk over
        four hook dicts (~25 us a call, a quarter of a 200-tensor step); :meth:`step` does the same
        only when a hook is registered or the profiler is on. The other thing torch's method does,
        naming ``zero_grad``'s profiler range, is done here too."""
        compat.set_zero_grad_profile_name(self)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform a single optimization step (one kernel launch per device).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        With an unmodified ``torch.amp.GradScaler``, ``scaler.step(opt)`` sets ``grad_scale`` and
        ``found_inf`` on the optimizer: the kernel unscales the grads (and leaves them unscaled, as
        torch's fused optimizers do), and on inf/NaN skips the update, the states and ``step``
        without a host sync. Step pre/post hooks and the profiler range work as in torch.
        """
        if not self._graph_safe:  # graph-safe: prepare_step counted the EMA update
            self._count_ema_update()
        if closure is None and not self._hooked():
            self.engine.step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            return None
        return self._step_with_hooks(closure)

    def scaled_step(self, scale: torch.Tensor, update: tuple) -> bool:
        """A GradScaler's ``step(self)`` then ``update()`` in this optimizer's two launches (what
        :meth:`trainfuse.amp.GradScaler.step_and_update` runs): the statistics pass checks the
        grads scaled by ``scale``, takes the norm and updates the scale once it has read it
        (``update``: the scaler's ``(growth_tracker, growth_factor, backoff_factor,
        growth_interval)``); the update launch divides by the scale read. The profiler sees it as
        a step. True when done; False, nothing done, where it cannot (step hooks, which torch's
        step path runs, params on several devices or on the torch path, sharded params, no
        gradient)."""
        if self._step_hooks():
            return False
        if not compat.profiler_enabled():
            return self._scaled_step(scale, update)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            done = self._scaled_step(scale, update)
            compat.run_optimizer_step_code(self)
            return done

    def _scaled_step(self, scale: torch.Tensor, update: tuple) -> bool:
        if self._graph_safe:  # prepare_step counted the EMA update and wrote its weight
            return self.engine.scaled_step(scale, update)
        ema = self._ema if self._ema is not None and self._ema.enabled else None
        self.ema_weight = None if ema is None else 1.0 - ema.decay(ema.updates + 1)
        if not self.engine.scaled_step(scale, update):
            return False
        if ema is not None:
            ema.updates += 1
        return True

    def fused_step(self) -> bool:
        """:meth:`step` without a closure or a GradScaler, where it runs on the kernels alone: the
        statistics pass where clipping by norm needs one, the update launch (a Muon optimizer's
        Newton-Schulz part between them). What :class:`trainfuse.graphs.GraphedOptimizerStep`
        captures when no scaler runs (bf16 or float32 training): graph-safe, it replays as the
        next step. True when done; False, nothing done, where it cannot (step hooks, which
        torch's step path runs, params on several devices or on the torch path, sharded params,
        no gradient): call :meth:`step` then."""
        if self._step_hooks():
            return False
        if not compat.profiler_enabled():
            return self._fused_step()
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            done = self._fused_step()
            compat.run_optimizer_step_code(self)
            return done

    def _fused_step(self) -> bool:
        if self._graph_safe:  # prepare_step counted the EMA update and wrote its weight
            return self.engine.fused_step()
        ema = self._ema if self._ema is not None and self._ema.enabled else None
        self.ema_weight = None if ema is None else 1.0 - ema.decay(ema.updates + 1)
        if not self.engine.fused_step():
            return False
        if ema is not None:
            ema.updates += 1
        return True

    def _count_ema_update(self) -> None:
        """One more update of the attached EMA, and this step's lerp weight (None without one)."""
        if self._ema is not None and self._ema.enabled:
            self._ema.updates += 1
            self.ema_weight = 1.0 - self._ema.decay(self._ema.updates)
        else:
            self.ema_weight = None

    # ---- graph-safe steps --------------------------------------------------------------------
    @property
    def graph_safe(self) -> bool:
        """Whether graph-safe steps are on (:meth:`set_graph_safe`): the update launch reads the
        EMA weight from device memory, which :meth:`prepare_step` fills before each step."""
        return self._graph_safe

    def set_graph_safe(self, on: bool) -> None:
        """Turn graph-safe steps on or off.

        On, every value a step's launches read is in device memory: the tables, the
        hyperparameters, GradScaler's scale and growth tracker, and the EMA weight, which the
        update launch then reads from a device tensor instead of taking it as an argument. Call
        :meth:`prepare_step` before each step: a step captured in a CUDA graph then replays as the
        next step (:class:`trainfuse.graphs.GraphedOptimizerStep` does both). Off, a step takes
        the EMA weight as an argument again and counts the EMA update itself. Not carried by
        copies or pickles.

        Args:
            on: True for graph-safe steps, False for the usual ones.

        Raises:
            TypeError: ``on`` for a class whose :attr:`capturable` is False.
        """
        if on and not self.capturable:
            name = type(self).__name__
            raise TypeError(f"{name}.set_graph_safe: {name}'s step cannot be captured in a CUDA graph "
                            f"({name}.capturable is False)")
        self._graph_safe = bool(on)

    def capture_view(self) -> CaptureView:
        """What a CUDA graph captured around a step now would hold of this optimizer's tables:
        their generation, the params' one device and the params in table order
        (:meth:`trainfuse.optim.plans.PlanCache.capture_view`: read as they are, no check, no
        rebuild)."""
        return self.engine.plans.capture_view()

    def prepare_step(self) -> None:
        """Graph-safe optimizers (:meth:`set_graph_safe`): the host part of the next step. Counts
        the EMA update and writes its weight and the groups' hyperparameters into the device
        memory the launches read (no sync), so a step captured in a CUDA graph and replayed after
        this is the next step, while the grads stay where they were and the tables hold
        (``capture_view().generation`` unchanged; docs/design/engine.md, "Graph-safe steps")."""
        if not self._graph_safe:
            raise RuntimeError(f"{type(self).__name__}.prepare_step: call set_graph_safe(True) first (the "
                               "launches then read the EMA weight from device memory)")
        self._count_ema_update()
        self.engine.write_ema_weight()
        self.engine.refresh_hparams()

    def _step_hooks(self) -> bool:
        return compat.has_step_hooks(self)

    def _hooked(self) -> bool:
        """Whether a step must go through torch's wrapper: step hooks set, or the profiler on."""
        return self._step_hooks() or compat.profiler_enabled()

    def _step_with_hooks(self, closure):
        args, kwargs = (self,), {"closure": closure}
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            pre_hooks, post_hooks = compat.step_hooks(self)
            for hook in pre_hooks:
                result = hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            f"optimizer step pre-hook must return None or (args, kwargs), got {result}")
                    args, kwargs = result
            closure = kwargs.get("closure", closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with torch.no_grad():
                self.engine.step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            compat.run_optimizer_step_code(self)
            for hook in post_hooks:
                hook(self, args, kwargs)
        return loss

    # ---- state ---------------------------------------------------------------------------------
    def prepare_state(self, p: torch.Tensor, group: dict[str, Any], kernels: bool):
        """The state tensors of ``p`` in kernel operand order, its step counter and its float32
        master (or None), created on first use and made to match the param's device and memory
        layout (a state_dict saved from a contiguous model loads into a channels_last one) and
        dtype (float32 beside a master)."""
        keys = self.state_keys(group)
        master = self.master_of(p, group)
        like = p if master is None else master
        # torch.optim leaves no entry for stateless params (SGD without momentum)
        state = self.state[p] if keys or master is not None else self.state.get(p, {})
        if any(state.get(k) is None for k in keys):
            self.init_state(p, group, state, like)
        states = []
        for k in keys:
            t = state[k]
            if kernels or master is not None:
                t = conform(t, like)
                state[k] = t
            states.append(t)
        step = self.step_tensor(p, state, kernels)
        return states, step, master

    def _new_step(self, p: torch.Tensor, kernels: bool, value: float = 0.0) -> torch.Tensor:
        if kernels:  # torch's fused layout: a float32 scalar on the param's device
            return torch.full((), value, dtype=torch.float32, device=p.device)
        return torch.tensor(value, dtype=compat.scalar_dtype())  # torch's default layout

    def _conform_step(self, step: Any, p: torch.Tensor, kernels: bool) -> torch.Tensor:
        if not torch.is_tensor(step):
            return self._new_step(p, kernels, float(step))
        if kernels and (step.device != p.device or step.dtype != torch.float32 or step.dim() != 0):
            return step.detach().reshape(()).to(device=p.device, dtype=torch.float32)
        return step

    def check_hparams(self) -> None:
        """Validate every group's hyperparameters; runs at construction and when one changes."""
        self._hparams_checked = True
        for group in self.param_groups:
            self.validate_group(group)

    # ---- client hooks --------------------------------------------------------------------------
    def state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def init_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any],
                    like: torch.Tensor) -> None:
        """Create the missing state tensors of ``p`` (not its step counter) like ``like`` (the
        param, or its float32 master)."""
        raise NotImplementedError

    def step_tensor(self, p: torch.Tensor, state: dict[str, Any], kernels: bool) -> torch.Tensor:
        raise NotImplementedError

    def validate_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def hparams_row(self, group: dict[str, Any]) -> list[float | torch.Tensor]:
        raise NotImplementedError

    def torch_group_step(self, group: dict[str, Any], params: list, grads: list,
                          weights: list) -> None:
        """torch.optim's step for ``params`` (whose states it uses), applied to ``weights`` (the
        params themselves, or their float32 masters)."""
        raise NotImplementedError


# torch's Optimizer.__init__ calls this method by name (trainfuse._runtime.compat.STEP_PATCH_METHOD)
setattr(FusedOptimizer, compat.STEP_PATCH_METHOD, FusedOptimizer._keep_step_unwrapped)
# GradScaler.step hands the step ``grad_scale`` / ``found_inf`` instead of unscaling and checking itself
setattr(FusedOptimizer, compat.STEP_SUPPORTS_AMP_SCALING, True)


__all__ = ["MASTER_KEY", "FusedOptimizer", "_as_float", "scalar"]
