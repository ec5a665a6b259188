"""What every fused optimizer shares: torch.optim's contract on top of the multi-tensor engine.

A client subclass supplies the per-param state (:meth:`_state_keys`, :meth:`_init_state`), its
per-group hyperparameters as a fixed-width row (:meth:`_hparams`), its Triton kernel (``_kernel``,
written with ``trainfuse._engine.kernels``) and the torch reference step
(:meth:`_torch_group_step`). Everything else (tables, caching, AMP, validation, state_dict) lives
here and in ``trainfuse._engine``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim.optimizer import (
    Optimizer,
    _get_scalar_dtype,
    _global_optimizer_post_hooks,
    _global_optimizer_pre_hooks,
)

from trainfuse._engine.table import MultiTensorEngine, conform


def scalar(value: Any, name: str) -> float | torch.Tensor:
    """A float, or a one-element tensor kept as a tensor (read on the device, never synced)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return value
    return float(value)


def _as_float(value: float | torch.Tensor) -> float:
    return float(value.detach().cpu()) if isinstance(value, torch.Tensor) else float(value)


class FusedOptimizer(Optimizer):
    """Base class: a ``torch.optim.Optimizer`` whose step is one multi-tensor kernel launch."""

    # GradScaler hands us ``grad_scale`` / ``found_inf`` instead of unscaling and checking itself.
    _step_supports_amp_scaling = True
    # Width of one group's row in the float64 hyperparameter table the kernel reads.
    HP_WIDTH = 8
    # Set once the constructor has validated the first groups; later groups are checked on add.
    _hparams_checked = False

    def __init__(self, params, defaults: dict[str, Any]):
        self._engine = MultiTensorEngine(self)
        super().__init__(params, defaults)
        self._check_hparams()

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
                self._check_hparams()
        except ValueError:
            self.param_groups.pop()
            raise
        self._engine.invalidate()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._engine.invalidate()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._engine = MultiTensorEngine(self)

    def _patch_step_function(self) -> None:
        # torch wraps every Optimizer.step in a profiler range plus a walk over four hook dicts
        # (~25 us a call, a quarter of a 200-tensor step); step() below does the same only when a
        # hook is registered or the profiler is on
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform a single optimization step (one kernel launch per device).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        With an unmodified ``torch.amp.GradScaler``, ``scaler.step(opt)`` sets ``grad_scale`` and
        ``found_inf`` on the optimizer: the kernel unscales the grads (and leaves them unscaled, as
        torch's fused optimizers do), and on inf/NaN skips the update, the states and ``step``
        without a host sync. Step pre/post hooks and the profiler range work as in torch.
        """
        if (closure is None and not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks
                and not self._optimizer_step_pre_hooks and not self._optimizer_step_post_hooks
                and not torch.autograd._profiler_enabled()):
            self._engine.step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            return None
        return self._step_with_hooks(closure)

    def _step_with_hooks(self, closure):
        args, kwargs = (self,), {"closure": closure}
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            for hook in chain(_global_optimizer_pre_hooks.values(),
                              self._optimizer_step_pre_hooks.values()):
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
                self._engine.step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            self._optimizer_step_code()
            for hook in chain(self._optimizer_step_post_hooks.values(),
                              _global_optimizer_post_hooks.values()):
                hook(self, args, kwargs)
        return loss

    # ---- state ---------------------------------------------------------------------------------
    def _prepare_state(self, p: torch.Tensor, group: dict[str, Any], kernels: bool):
        """The state tensors of ``p`` in kernel operand order and its step counter, created on
        first use and made to match the param's dtype, device and memory layout (a state_dict
        saved from a contiguous model loads into a channels_last one)."""
        keys = self._state_keys(group)
        # torch.optim leaves no entry for stateless params (SGD without momentum)
        state = self.state[p] if keys else self.state.get(p, {})
        if any(state.get(k) is None for k in keys):
            self._init_state(p, group, state)
        states = []
        for k in keys:
            t = state[k]
            if kernels:
                t = conform(t, p)
                state[k] = t
            states.append(t)
        step = self._step_tensor(p, state, kernels)
        return states, step

    def _new_step(self, p: torch.Tensor, kernels: bool, value: float = 0.0) -> torch.Tensor:
        if kernels:  # torch's fused layout: a float32 scalar on the param's device
            return torch.full((), value, dtype=torch.float32, device=p.device)
        return torch.tensor(value, dtype=_get_scalar_dtype())  # torch's default layout

    def _conform_step(self, step: Any, p: torch.Tensor, kernels: bool) -> torch.Tensor:
        if not torch.is_tensor(step):
            return self._new_step(p, kernels, float(step))
        if kernels and (step.device != p.device or step.dtype != torch.float32 or step.dim() != 0):
            return step.detach().reshape(()).to(device=p.device, dtype=torch.float32)
        return step

    def _check_hparams(self) -> None:
        """Validate every group's hyperparameters; runs at construction and when one changes."""
        self._hparams_checked = True
        for group in self.param_groups:
            self._validate_group(group)

    # ---- client hooks --------------------------------------------------------------------------
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Create the missing state tensors of ``p`` (not its step counter)."""
        raise NotImplementedError

    def _step_tensor(self, p: torch.Tensor, state: dict[str, Any], kernels: bool) -> torch.Tensor:
        raise NotImplementedError

    def _validate_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _hparams(self, group: dict[str, Any]) -> list[float | torch.Tensor]:
        raise NotImplementedError

    def _torch_group_step(self, group: dict[str, Any], params: list, grads: list) -> None:
        raise NotImplementedError


__all__ = ["FusedOptimizer", "_as_float", "scalar"]
