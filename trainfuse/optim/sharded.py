"""Clipping norms over sharded gradients: each rank of a process group holds some of the grads
(FSDP's shards), and the norm that clips them is the norm of all of them.

A statistics pass leaves ``out = [norm, clip coefficient, inf/NaN flag, ...]`` for this rank's
grads on the device; :func:`combine_stats_` makes it the group's with one all-reduce of
``norm ** p`` (a sum; an inf or NaN on any rank makes the sum inf or NaN, so the flag follows from
it), or a max for the inf-norm, on the device and without a host sync. The coefficient is then
``min(max_norm / (total + 1e-6), 1)``, torch's ``clip_grad_norm_`` formula.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from trainfuse.optim.contract import OptimizerClient


def combine_stats_(out: torch.Tensor, group: Any, max_norm: float | None, norm_type: float | None) -> None:
    """Turn a statistics pass's ``out`` for this rank's grads into the one for every rank's.

    Args:
        out: ``[norm, clip coefficient, inf/NaN flag, ...]`` (float32, on the grads' device),
            updated in place.
        group: the process group whose ranks hold the other grads.
        max_norm: the clipping norm (None: no clipping, only the inf/NaN flag is combined).
        norm_type: the norm's order (None with ``max_norm`` None).
    """
    if max_norm is None or norm_type is None:
        flag = out[2:3].clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        out[2:3].copy_(flag)
        return
    if math.isinf(norm_type):
        both = out[0:3:2].clone()  # the norm and the flag: a max reduces both
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        total = both[0:1]
        flag = torch.maximum(both[1:2], (~torch.isfinite(total)).float())
    else:
        power = out[0:1].double().pow(norm_type)  # float64 for the sum over ranks
        dist.all_reduce(power, op=dist.ReduceOp.SUM, group=group)
        total = power.pow(1.0 / norm_type).float()
        flag = (~torch.isfinite(total)).float()
    out[0:1].copy_(total)
    out[1:2].copy_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    out[2:3].copy_(flag)


def combine_client_stats_(client: OptimizerClient, out: torch.Tensor, clipping: bool, group: Any) -> None:
    """:func:`combine_stats_` for a fused optimizer's statistics pass, where its params are
    sharded over ``group`` (its ``shard_group``, or its DTensor params' group; nothing to do where
    that is None)."""
    if group is not None:
        check_group(group, type(client).__name__)
        combine_stats_(out, group, client.max_grad_norm if clipping else None, 2.0 if clipping else None)


def global_norm(grads: list[torch.Tensor], norm_type: float, group: Any,
                device: torch.device | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of every rank's ``grads`` viewed as one vector (torch's functions
    for this rank's part, then one all-reduce): the torch path's counterpart of the kernels'. A
    rank without grads joins with a zero norm on ``device``."""
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type)
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    out = torch.stack([local.float(), local.new_zeros((), dtype=torch.float32),
                       (~torch.isfinite(local)).float()])
    combine_stats_(out, group, 1.0, norm_type)
    return out[0].to(local.dtype)


def check_group(group: Any, owner: str) -> None:
    """Raise unless ``group`` is None or a process group (``torch.distributed`` initialized)."""
    if group is None:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{owner}: shard_group is set but torch.distributed is not initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{owner}: shard_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(group).__name__}")


__all__ = ["check_group", "combine_client_stats_", "combine_stats_", "global_norm"]
