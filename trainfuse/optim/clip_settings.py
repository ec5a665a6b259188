"""A fused optimizer's clipping settings (``max_grad_norm``, ``max_grad_value``): their check, and
the device tensor the update kernel clamps with (:class:`ClipSettings`, a base of
:class:`~trainfuse.optim.FusedOptimizer`)."""

from __future__ import annotations

import numbers

import torch


class ClipSettings:
    """``max_grad_norm`` / ``max_grad_value`` as plain attributes, checked where they are read.

    The class using it sets both attributes and ``_clip_values`` (an empty dict) first."""

    max_grad_norm: float | None
    max_grad_value: float | None
    _clip_values: dict[torch.device, tuple[float, torch.Tensor]]

    def check_clipping(self) -> None:
        """Raise a ValueError naming the argument for a ``max_grad_value`` that is not a number
        >= 0 (NaN, negative, not a number), or for ``max_grad_norm`` and ``max_grad_value`` both
        set. Runs at construction and, since both are plain attributes, again when one changed."""
        name, value = type(self).__name__, self.max_grad_value
        if value is None:
            return
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value >= 0.0:
            raise ValueError(f"{name}: max_grad_value must be a number >= 0 (inf: nothing is clipped) "
                             f"or None, got {value!r}")
        if self.max_grad_norm is not None:
            raise ValueError(f"{name}: max_grad_norm={self.max_grad_norm} and max_grad_value={value} are "
                             "both set; clip by norm or by value, not both")

    def clip_value_on(self, device: torch.device) -> torch.Tensor:
        """``max_grad_value`` as the 1-element float32 tensor on ``device`` that the update kernel
        clamps the unscaled grads with: made once per device, refilled in place (after
        :meth:`check_clipping`) when either clipping attribute changed since the last step."""
        value = self.max_grad_value
        cached = self._clip_values.get(device)
        if cached is not None and cached[0] == value and self.max_grad_norm is None:
            return cached[1]
        self.check_clipping()
        bound = torch.empty(1, dtype=torch.float32, device=device) if cached is None else cached[1]
        bound.fill_(float(value))
        self._clip_values[device] = (value, bound)
        return bound


__all__ = ["ClipSettings"]
