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
from trainfuse.optim.portable import MASTER_GROUP_KEY, torch_state_dict

# torch.optim's layout of a fused optimizer's state_dict (shared with the ultralytics trainer)
torch_optimizer_state = torch_state_dict


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
