"""torch's GradScaler -> trainfuse's (same settings and state), and back.

:class:`trainfuse.amp.GradScaler` is torch's with the inf/NaN check run by the fused optimizer's
statistics pass, and ``step_and_update`` in two launches. Only an exact ``torch.amp.GradScaler``
is swapped: a subclass or another device's scaler is the user's or the framework's own.
"""

from __future__ import annotations

import torch

from trainfuse.amp import GradScaler


def fused_scaler(old: object, device: str) -> GradScaler | None:
    """The trainfuse GradScaler that continues ``old``, or None to keep ``old`` (not a
    ``torch.amp.GradScaler`` exactly: None, a subclass, an NPU scaler, or already ours).

    Args:
        old: the scaler in use.
        device: the device type the scaler serves (``"cuda"``, ``"xpu"``).
    """
    if type(old) is not torch.amp.GradScaler:
        return None
    new = GradScaler(device, enabled=old.is_enabled())
    if old.is_enabled():  # a disabled scaler's state_dict is empty
        new.load_state_dict(old.state_dict())
    return new


def hand_back_scaler(new: GradScaler, old: torch.amp.GradScaler) -> torch.amp.GradScaler:
    """Give ``old`` the state ``new`` reached (scale, growth tracker), and return it."""
    if old.is_enabled():
        old.load_state_dict(new.state_dict())
    return old


__all__ = ["fused_scaler", "hand_back_scaler"]
