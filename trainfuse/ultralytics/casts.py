"""Cast fusion in FusedDetectionTrainer: 16-bit weights with float32 masters in the fused optimizer
(:class:`trainfuse.clients.CastState`), and what its checkpoints save.

Under ultralytics' AMP every forward casts each conv weight to float16 (one launch each) and the
backward casts each weight grad back to float32 (another): about 120 launches an iteration on
yolov5n, some 4 ms of a host-bound 45 ms iteration. With :func:`trainfuse.amp.fuse_casts` the weights
*are* float16 (bfloat16 under ``amp="bf16"``), their float32 masters live in the optimizer's state
and its update writes both, so no cast runs. BatchNorm params stay float32, as autocast keeps them.

What differs from stock, on purpose: the grads of the cast weights are 16-bit, so the
``nbs / batch`` accumulated backward passes add in 16 bits (stock adds them in float32). GradScaler
sees the same overflows (the conv backward makes 16-bit grads in both), and the update itself runs
in float32 on the masters.

Checkpoints stay stock: the optimizer state is saved in torch.optim's layout (no masters; the EMA,
which ultralytics saves as the model, is float32), and a resume makes the masters again from the
float32 weights ultralytics loads.
"""

from __future__ import annotations

from typing import Any

import torch

from trainfuse.optim import FusedOptimizer, torch_state_dict


def cast_dtype(trainer: Any) -> torch.dtype | None:
    """The 16-bit dtype the trainer's autocast runs in, or None where nothing is cast (AMP off, no
    CUDA device, or an optimizer that stayed stock)."""
    if not getattr(trainer, "amp", False) or trainer.device.type != "cuda":
        return None
    if not isinstance(getattr(trainer, "optimizer", None), FusedOptimizer):
        return None
    return torch.bfloat16 if trainer.args.amp == "bf16" else torch.float16


class TorchLayoutOptimizer:
    """What ``BaseTrainer.save_model`` reads of the optimizer, its ``state_dict()``, in
    torch.optim's layout (:func:`trainfuse.optim.torch_state_dict`)."""

    def __init__(self, optimizer: FusedOptimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return torch_state_dict(self.optimizer.state_dict())


__all__ = ["TorchLayoutOptimizer", "cast_dtype"]
