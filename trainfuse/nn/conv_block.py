"""A convolution block's BatchNorm2d and SiLU as one op (:func:`trainfuse.nn.bn_silu.batch_norm_silu`),
put on the block as an instance ``forward`` and taken off again; and the same for a BatchNorm2d
followed by a SiLU inside an ``nn.Sequential`` (:func:`fuse_pairs`).

A block is any module with ``conv`` (``nn.Conv2d``), ``bn`` (``nn.BatchNorm2d``) and ``act``
(``nn.SiLU``) children whose forward is ``act(bn(conv(x)))``: ultralytics' ``Conv``, which every
YOLO model is built from. The caller says which modules are such blocks (their forward is not
read): :func:`install` takes one. The BatchNorm runs as ``nn.BatchNorm2d.forward`` does (its
``num_batches_tracked`` counted, ``momentum=None``'s cumulative average, the running statistics
used outside training), so the parameters, buffers, ``state_dict`` and checkpoints stay the
module's own; a deep copy of the block (an EMA, a saved checkpoint) gets the class's forward.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from trainfuse.nn.bn_silu import batch_norm_silu, split_batch_norm_silu


def fusable(block: nn.Module) -> bool:
    """Whether ``block`` has the children :func:`install` needs: ``conv`` a ``Conv2d``, ``bn`` a
    plain ``BatchNorm2d`` (no subclass: SyncBatchNorm reduces across ranks), ``act`` a ``SiLU``,
    and no instance forward set already."""
    return (isinstance(getattr(block, "conv", None), nn.Conv2d)
            and type(getattr(block, "bn", None)) is nn.BatchNorm2d
            and type(getattr(block, "act", None)) is nn.SiLU and "forward" not in block.__dict__)


def batch_norm_silu_module(bn: nn.BatchNorm2d, x: torch.Tensor, op=batch_norm_silu):
    """``silu(bn(x))`` with ``bn``'s own bookkeeping, as ``nn.BatchNorm2d.forward`` does it (its
    ``num_batches_tracked`` counted by ``op``); ``op``: :func:`~trainfuse.nn.bn_silu.batch_norm_silu`,
    its split form (two halves), or an op that takes the same arguments."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    tracked = None
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        if bn.momentum is None:  # a cumulative average: torch reads the count on the host too
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked)
        else:  # counted by the op (inside its statistics' launch)
            tracked = bn.num_batches_tracked
    batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    keep = not bn.training or bn.track_running_stats
    return op(x, bn.running_mean if keep else None, bn.running_var if keep else None, bn.weight, bn.bias,
              batch_stats, factor, bn.eps, num_batches_tracked=tracked)


def halves(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A :func:`fusable` block's output (an even number of channels) as its two channel halves,
    each a dense tensor (:func:`~trainfuse.nn.bn_silu.split_batch_norm_silu`): what
    ``block(x).chunk(2, 1)`` holds, without the strided views."""
    return batch_norm_silu_module(block.bn, block.conv(x), split_batch_norm_silu)


class InstanceForward:
    """A forward put on one module as an instance attribute (:func:`install`, and the ultralytics
    client's C2f blocks); a deep copy of the module (an EMA, a checkpoint) gets its class's
    forward. Subclasses define ``__call__``."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __deepcopy__(self, memo: dict) -> types.MethodType:
        twin = memo.get(id(self.block))
        if twin is None:
            raise TypeError(f"{type(self).__name__}: copy the module, not its forward")
        return types.MethodType(type(twin).forward, twin)


class _FusedForward(InstanceForward):
    """The forward :func:`install` puts on a block."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        block = self.block
        return batch_norm_silu_module(block.bn, block.conv(x))


def install(block: nn.Module) -> bool:
    """Run ``block``'s BatchNorm and SiLU as one op from now on (False, nothing done, where it is
    not :func:`fusable`)."""
    if not fusable(block):
        return False
    block.forward = _FusedForward(block)
    return True


def uninstall(block: nn.Module) -> None:
    """Give ``block`` its class's forward back."""
    if isinstance(block.__dict__.get("forward"), _FusedForward):
        del block.forward


class BatchNormSiLU2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` then SiLU as one op: what :func:`fuse_pairs` turns a Sequential's
    BatchNorm2d into (its class swapped in place: the same parameters, buffers and keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:  # BatchNorm2d's own check
            raise ValueError(f"expected 4D input (got {x.dim()}D input)")
        return batch_norm_silu_module(self, x)


def fusable_pairs(seq: nn.Sequential) -> list[int]:
    """The positions ``i`` of ``seq`` whose child ``i`` is a plain ``BatchNorm2d`` and child ``i + 1``
    a ``SiLU``, in a Sequential that runs its children in order (its class's forward is
    ``nn.Sequential``'s)."""
    if type(seq).forward is not nn.Sequential.forward:
        return []
    children = list(seq)
    return [i for i in range(len(children) - 1)
            if type(children[i]) is nn.BatchNorm2d and type(children[i + 1]) is nn.SiLU]


def fuse_pairs(seq: nn.Sequential, positions: list[int]) -> list[tuple[int, nn.Module]]:
    """Each BatchNorm2d at ``positions`` (:func:`fusable_pairs`) computes its SiLU too and the SiLU
    after it becomes ``nn.Identity``; returns ``(position, SiLU)`` for :func:`unfuse_pairs`."""
    taken = []
    for i in positions:
        seq[i].__class__ = BatchNormSiLU2d
        taken.append((i, seq[i + 1]))
        seq[i + 1] = nn.Identity()
    return taken


def unfuse_pairs(seq: nn.Sequential, taken: list[tuple[int, nn.Module]]) -> None:
    """Undo :func:`fuse_pairs`: the BatchNorm2d and the SiLU module back."""
    for i, silu in taken:
        seq[i].__class__ = nn.BatchNorm2d
        seq[i + 1] = silu


def installed(block: nn.Module) -> bool:
    """Whether :func:`install` put its forward on ``block``."""
    return isinstance(block.__dict__.get("forward"), _FusedForward)


__all__ = ["BatchNormSiLU2d", "InstanceForward", "batch_norm_silu_module", "fusable", "fusable_pairs",
           "fuse_pairs", "halves", "install", "installed", "uninstall", "unfuse_pairs"]
