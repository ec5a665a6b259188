"""A GradScaler whose inf/NaN check is the fused optimizer's gradient-statistics pass.

``torch.amp.GradScaler`` works unchanged with trainfuse's optimizers (they take ``grad_scale`` and
``found_inf`` like torch's fused ones), but its ``step`` still runs its own check first: fills,
a foreach unscale-and-check over every gradient, a sum and a multiply — five or more launches
before the optimizer's. This subclass asks a fused optimizer for the check instead: one launch
that also takes the clipping norm when ``max_grad_norm`` is set. With it, ultralytics' optimizer
phase (unscale, clip, step, update, zero_grad, EMA) is three launches, or two::

    scaler = trainfuse.amp.GradScaler("cuda")
    opt = FusedSGD(params, lr, momentum=0.937, nesterov=True, max_grad_norm=10.0)
    opt.attach_ema(ema)            # FusedEMA(model)
    scaler.scale(loss).backward()
    scaler.step(opt)               # 1: norm + inf check   2: clipped update + EMA (params, buffers)
    scaler.update()                # 3: torch's scale update
    opt.zero_grad()                # set_to_none: no launch

``scaler.step_and_update(opt)`` does both calls in two launches: the first one also updates the
scale, once every program has read it. Every other optimizer, and ``unscale_`` called by hand,
take torch's path unchanged.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from trainfuse.optim._base import FusedOptimizer


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments and state_dict) with a one-launch inf check for
    trainfuse's fused optimizers."""

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled or not isinstance(optimizer, FusedOptimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        grad_scale = None
        if state["stage"] is OptState.READY:
            found = optimizer.check_grads(self._scale)
            if found is None:  # the optimizer runs torch's path here: torch's check
                return super().step(optimizer, *args, **kwargs)
            state["found_inf_per_device"] = found
            grad_scale = self._scale
        found_infs = list(state["found_inf_per_device"].values())
        found_inf = found_infs[0] if len(found_infs) == 1 else sum(
            t.to(self._scale.device, non_blocking=True) for t in found_infs)
        optimizer.grad_scale = grad_scale
        optimizer.found_inf = found_inf
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
            optimizer.discard_grad_check()
        state["stage"] = OptState.STEPPED
        return retval

    def step_and_update(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``step(optimizer)`` then ``update()``, with the same results and state. For a trainfuse
        fused optimizer on one device, right after the backward (no ``unscale_`` and no other
        optimizer stepped since the last update), both run in the optimizer's two launches: the
        statistics pass also does ``update()``'s scale arithmetic, after every one of its
        programs has read the scale the step divides by. Elsewhere (and for growth or backoff
        factors that are not exact in float32, which torch multiplies in float64) it calls the
        two methods. ``update(new_scale)`` has no counterpart here: call the two methods."""
        fused = None if args or kwargs else self.fused_update(optimizer)
        if fused is not None and optimizer.scaled_step(*fused):
            self._per_optimizer_states.clear()  # what update() leaves: no optimizer seen
            return None
        retval = self.step(optimizer, *args, **kwargs)
        self.update()
        return retval

    def fused_update(self, optimizer: torch.optim.Optimizer) -> tuple | None:
        """``(scale, update)`` for ``optimizer.scaled_step`` where :meth:`step_and_update` runs as
        the fused optimizer's two launches (``update``: the growth tracker, growth and backoff
        factors, growth interval), or None where it calls ``step`` then ``update``."""
        if not (self._enabled and isinstance(optimizer, FusedOptimizer) and self._scale is not None
                and _float32_exact(self._growth_factor) and _float32_exact(self._backoff_factor)
                and self._scale.dtype == torch.float32 and self._growth_tracker.dtype == torch.int32):
            return None
        states = self._per_optimizer_states
        if states and not (len(states) == 1 and id(optimizer) in states
                           and states[id(optimizer)]["stage"] is OptState.READY):
            return None
        return self._scale, (self._growth_tracker, self._growth_factor, self._backoff_factor,
                             self._growth_interval)


    def device_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(scale, growth tracker)``: the device tensors the fused step reads and updates in
        place (None before the first ``scale()``). A graph captured around ``step_and_update``
        holds them; ``load_state_dict`` may replace them."""
        return self._scale, self._growth_tracker


def _float32_exact(x: float) -> bool:
    try:
        return struct.unpack("f", struct.pack("f", x))[0] == x
    except OverflowError:
        return False


__all__ = ["GradScaler"]
