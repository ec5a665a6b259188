"""What FusedTraining's checkpoints hold: stock Lightning's layout, loadable without trainfuse.

``state_dict`` holds float32 weights (the masters of cast params), which a plain model loads with
``strict=True``; ``optimizer_states`` are in torch.optim's layout (no float32 master entries, no
``master_weights`` group key, ``step`` a CPU float32 scalar), which torch's AdamW/Adam/SGD load.
Nothing is lost: on resume the masters are made again from the float32 weights.

With an EMA the layout is Lightning's ``WeightAveraging`` one: ``state_dict`` holds the average
(what ``validate``/``test``/``predict`` with ``ckpt_path=``, ``load_from_checkpoint`` and a run
without the callback load), ``current_model_state`` the live weights and ``averaging_state`` the
number of updates (``n_averaged``). A fit resumed under FusedTraining or under
``EMAWeightAveraging`` continues the live weights and the average from there.
"""

from __future__ import annotations

from typing import Any

import torch

from trainfuse.optim.portable import torch_state_dict


def plain_checkpoint(checkpoint: dict[str, Any], live: dict[str, torch.Tensor],
                     average: dict[str, torch.Tensor] | None = None, updates: int = 0) -> None:
    """Rewrite a Lightning checkpoint dict in place into the layout above.

    Args:
        checkpoint: the dict ``on_save_checkpoint`` receives.
        live: state_dict key -> the live value to save instead of the module's: the float32
            masters of params fuse_casts made 16-bit, the live values while the EMA is swapped in.
        average: the EMA under state_dict keys, or None without one.
        updates: the EMA updates done so far.
    """
    if "state_dict" in checkpoint:
        # on the module's device: a save after the fit finds the module moved to the CPU by
        # Lightning's teardown, the average and the displaced live values still on the GPU
        state = {k: _like(live.get(k), v) for k, v in checkpoint["state_dict"].items()}
        if average is not None:
            checkpoint["current_model_state"] = state
            state = {k: _like(average.get(k), v) for k, v in state.items()}
            checkpoint["averaging_state"] = {"n_averaged": torch.tensor(updates, dtype=torch.long)}
        checkpoint["state_dict"] = state
    states = checkpoint.get("optimizer_states")
    if states:
        checkpoint["optimizer_states"] = [torch_state_dict(s) for s in states]


def _like(value: torch.Tensor | None, saved: torch.Tensor) -> torch.Tensor:
    """``value`` on ``saved``'s device (``saved`` itself when ``value`` is None)."""
    if value is None:
        return saved
    return value if value.device == saved.device else value.to(saved.device)


def saved_average(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int] | None:
    """The average a checkpoint in WeightAveraging's layout holds (written by FusedTraining or by
    Lightning's averaging callbacks): ``(its state_dict, updates)``, or None for another layout."""
    if "current_model_state" not in checkpoint or "averaging_state" not in checkpoint:
        return None
    updates = checkpoint["averaging_state"].get("n_averaged", 0)
    return checkpoint["state_dict"], int(updates)


__all__ = ["plain_checkpoint", "saved_average"]
