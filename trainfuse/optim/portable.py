"""A fused optimizer's state in torch.optim's layout, for checkpoints that load without trainfuse."""

from __future__ import annotations

from typing import Any

import torch

from trainfuse.optim._base import MASTER_KEY

MASTER_GROUP_KEY = "master_weights"  # the group option that asks for float32 masters


def torch_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (a fused optimizer's ``state_dict()``) as torch.optim's AdamW/Adam/SGD write
    it: no float32 master entries, no ``master_weights`` group key, ``step`` a CPU float32 scalar.

    New dicts are returned; the live optimizer state is not touched. Nothing is lost for a resume
    from float32 weights: a fused optimizer makes the masters again from them (``fuse_casts``).
    """
    if "state" not in state_dict:  # FSDP's rank-zero-only optimizer state: empty on the other ranks
        return state_dict
    state = {}
    for idx, entry in state_dict["state"].items():
        entry = {k: v for k, v in entry.items() if k != MASTER_KEY}
        if not entry:  # only a master (a param cast to 16 bits that never stepped): torch has no entry
            continue
        step = entry.get("step")
        if torch.is_tensor(step):
            entry["step"] = step.detach().to(device="cpu", dtype=torch.float32).reshape(())
        state[idx] = entry
    groups = [{k: v for k, v in g.items() if k != MASTER_GROUP_KEY} for g in state_dict["param_groups"]]
    return {**state_dict, "state": state, "param_groups": groups}


__all__ = ["MASTER_GROUP_KEY", "torch_state_dict"]
