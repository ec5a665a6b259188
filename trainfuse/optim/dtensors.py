"""Params that are DTensors (FSDP2's ``fully_shard``, a DeviceMesh-sharded model): each rank steps
its own shard.

The kernels address each rank's local shard (param, grad, states, master, EMA tensor: the state
tensors themselves stay DTensors, so a state dict is sharded like the model's). The norm that clips
them, and GradScaler's inf/NaN check, are those of every rank's shards: the step driver combines its
per-rank statistics over :func:`shard_group`'s process group with one all-reduce on the device
(:mod:`trainfuse.optim.sharded`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from trainfuse._runtime.compat import local_tensor


def _loaded(module: str, name: str) -> Any:
    """Class ``name`` of ``module`` where something has imported that module, else None. A DTensor
    or an FSDP2 module exists only once its module is loaded, and importing
    ``torch.distributed.fsdp`` costs about a second: a process that never shards never pays it."""
    return getattr(sys.modules.get(module), name, None)


def _dtensor_class() -> Any:
    return _loaded("torch.distributed.tensor", "DTensor")


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s local shard where it is a DTensor, else ``t`` (None stays None)."""
    if is_dtensor(t):
        return local_tensor(t)
    return t


def locals_of(tensors: list) -> list:
    """:func:`local` of each of ``tensors``."""
    return [local(t) for t in tensors]


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``module`` or a submodule of it (such a
    module refuses ``copy.deepcopy``)."""
    cls = _loaded("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and any(isinstance(m, cls) for m in module.modules())


def tensor_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s state, not of its code: plain modules under its submodules' names
    holding a detached clone of each state_dict entry (DTensors stay DTensors, sharded alike),
    with the same state_dict keys. For modules that cannot be deep-copied (FSDP2's)."""
    root = nn.Module()
    clones: dict[int, torch.Tensor] = {}
    params = {id(p) for p in module.parameters()}
    for key, t in module.state_dict(keep_vars=True).items():
        owner = root
        *path, name = key.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        clone = clones.get(id(t))
        if clone is None:
            clone = t.detach().clone()
            if id(t) in params:
                clone = nn.Parameter(clone, requires_grad=False)
            clones[id(t)] = clone
        if isinstance(clone, nn.Parameter):
            owner.register_parameter(name, clone)
        else:
            owner.register_buffer(name, clone)
    return root


def shard_group(params: list[torch.Tensor], owner: str) -> Any:
    """The process group over which the DTensor ``params`` are sharded (None where no param is a
    DTensor or none is sharded): the ranks whose local grads together make the whole gradient.

    Every DTensor param must lie on one mesh and be sharded over the same one mesh dimension
    (FSDP2's ``fully_shard``, also with HSDP's replicate dimension); other layouts (tensor
    parallelism, a mix of sharded and replicated params) raise a ValueError: their norm needs
    DTensor's own ``torch.nn.utils.clip_grad_norm_``.
    """
    mesh, dims = None, None
    for i, p in enumerate(params):
        if not is_dtensor(p):
            continue
        shard = _loaded("torch.distributed.tensor", "Shard")
        sharded = tuple(d for d, pl in enumerate(p.placements) if isinstance(pl, shard))
        if mesh is None:
            mesh, dims = p.device_mesh, sharded
        elif p.device_mesh != mesh or sharded != dims:
            raise ValueError(
                f"{owner}: param {i} (shape {tuple(p.shape)}) is laid out as {p.placements} on "
                f"{p.device_mesh}, unlike the first DTensor param ({dims} sharded on {mesh}); the fused "
                "step takes params sharded over one mesh dimension alike (FSDP2's fully_shard)")
    if mesh is None or not dims:
        return None
    if len(dims) > 1:
        raise ValueError(f"{owner}: the params are sharded over {len(dims)} mesh dimensions; the fused step "
                         "takes params sharded over one (FSDP2's fully_shard)")
    return mesh.get_group(dims[0])


__all__ = ["is_dtensor", "is_fully_sharded", "local", "locals_of", "shard_group", "tensor_copy"]
