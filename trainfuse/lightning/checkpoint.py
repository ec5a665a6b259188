"""Plain checkpoints: what FusedTraining writes loads without trainfuse.

``state_dict`` holds float32 weights (the masters of cast params), which a plain model loads with
``strict=True``; ``optimizer_states`` are in torch.optim's layout (no float32 master entries, no
``master_weights`` group key, ``step`` a CPU float32 scalar), which torch's AdamW/Adam/SGD load.
Nothing is lost: on resume the masters are made again from the float32 weights.
"""

from __future__ import annotations

from typing import Any

import torch

from trainfuse.optim import MASTER_KEY

MASTER_GROUP_KEY = "master_weights"  # the group option that asks for float32 masters


def torch_optimizer_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A fused optimizer's ``state_dict()`` in torch.optim's layout (new dicts; the live
    optimizer state is not touched)."""
    state = {}
    for idx, entry in state_dict["state"].items():
        entry = {k: v for k, v in entry.items() if k != MASTER_KEY}
        step = entry.get("step")
        if torch.is_tensor(step):
            entry["step"] = step.detach().to(device="cpu", dtype=torch.float32).reshape(())
        state[idx] = entry
    groups = [{k: v for k, v in g.items() if k != MASTER_GROUP_KEY} for g in state_dict["param_groups"]]
    return {**state_dict, "state": state, "param_groups": groups}


def plain_checkpoint(checkpoint: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Rewrite a Lightning checkpoint dict in place so it holds the live float32 weights and
    torch-layout optimizer states.

    Args:
        checkpoint: the dict ``on_save_checkpoint`` receives.
        weights: state_dict key -> the value to save instead of the module's: the float32 masters
            of params fuse_casts made 16-bit, the live values while the EMA is swapped in.
    """
    if weights and "state_dict" in checkpoint:
        checkpoint["state_dict"] = {k: weights.get(k, v) for k, v in checkpoint["state_dict"].items()}
    states = checkpoint.get("optimizer_states")
    if states:
        checkpoint["optimizer_states"] = [torch_optimizer_state(s) for s in states]


__all__ = ["MASTER_GROUP_KEY", "MASTER_KEY", "plain_checkpoint", "torch_optimizer_state"]
