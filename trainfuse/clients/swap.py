"""A user's optimizer -> its fused counterpart from :mod:`trainfuse.optim.registry`, in place.

The fused optimizer holds the old one's param-group dicts themselves (same Parameter objects in
the same order, every key kept, the user's own included) and its state, so it continues exactly
where the old one stopped; every LR scheduler that drove the old one is pointed at the new one.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from trainfuse._runtime import compat
from trainfuse.optim import FusedOptimizer
from trainfuse.optim.registry import COUNTERPARTS, counterpart_of

# constructor options the fused classes set themselves
_OWN = {"params", "master_weights", "max_grad_norm", "max_grad_value"}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _accepted(cls: type) -> set[str]:
    return set(inspect.signature(cls).parameters) - _OWN


def _implied(cls: type) -> dict[str, Any]:
    """Group keys a fused class implies without taking them (FusedAdamW:
    ``decoupled_weight_decay=True``)."""
    return dict(getattr(cls, "IMPLIED_OPTIONS", {}))


def sparse_grad_params(module: nn.Module) -> dict[int, str]:
    """``id(param)`` -> module name, for the params that get sparse gradients
    (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``)."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            out[id(m.weight)] = name or type(m).__name__
    return out


def why_not_swappable(opt: torch.optim.Optimizer, *, kernels: bool, module: nn.Module | None = None,
                      fresh: bool = False) -> str | None:
    """Why ``opt`` must stay as it is, or None when :func:`swap_optimizer` can replace it.

    Args:
        opt: the user's optimizer.
        kernels: whether its params take the Triton kernels (their dtypes then matter).
        module: the model, to find params that will get sparse gradients (None: not checked).
        fresh: refuse an optimizer that already holds state (a client that rebuilds right after
            construction, where state means someone else stepped it).
    """
    counterpart = counterpart_of(type(opt))
    if counterpart is None:
        names = ", ".join(c.stock_name for c in COUNTERPARTS)
        return f"{type(opt).__name__} has no fused counterpart (exactly {names} are swapped)"
    cls = counterpart.fused_class
    if compat.has_step_hooks(opt, global_too=False):
        return "it has step hooks (register_step_pre_hook/post_hook), which belong to that object"
    if fresh and opt.state:
        return f"{type(opt).__name__} already holds state; it stays as built"
    missing = [k for k in counterpart.attributes if not hasattr(opt, k)]
    if missing:
        return (f"{type(opt).__name__} lacks {', '.join(missing)}, which its constructor sets (a deep copy "
                "or pickle loses them)")
    implied = _implied(cls)
    unknown = sorted(k for k in opt.defaults if k not in _accepted(cls) and k not in implied)
    if unknown:
        return f"option {unknown[0]}={opt.defaults[unknown[0]]!r} has no {cls.__name__} counterpart"
    sparse = sparse_grad_params(module) if module is not None else {}
    for gi, group in enumerate(opt.param_groups):
        if group.get("differentiable"):
            return f"param group {gi}: differentiable=True (the fused step is not differentiable)"
        for k, v in implied.items():
            if group.get(k, v) != v:
                return f"param group {gi}: {k}={group[k]!r} ({cls.__name__} implies {k}={v})"
        for p in group["params"]:
            if id(p) in sparse:
                return (f"param group {gi}: the weight of {sparse[id(p)]} (sparse=True) gets sparse "
                        f"gradients, which {cls.__name__} does not take")
            if p.is_complex():
                return f"param group {gi}: complex param of shape {tuple(p.shape)}"
            if kernels and p.dtype not in _KERNEL_DTYPES:
                return f"param group {gi}: {p.dtype} param (the kernels take float32, bfloat16, float16)"
    return None


def swap_optimizer(opt: torch.optim.Optimizer, max_grad_norm: float | None = None,
                   max_grad_value: float | None = None) -> FusedOptimizer:
    """The fused optimizer that continues ``opt``: its group dicts and list, its state.

    Args:
        opt: an optimizer :func:`why_not_swappable` accepts.
        max_grad_norm: clip the gradients to this global 2-norm inside the step (None: no clipping).
        max_grad_value: or clamp them to [-max_grad_value, max_grad_value] inside the step.

    Returns:
        The new optimizer; ``opt`` must not be stepped any more.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW([{"params": model.parameters(), "tag": "all"}], lr=1e-3)
        >>> fused = swap_optimizer(opt, max_grad_norm=1.0)
        >>> type(fused).__name__, fused.param_groups is opt.param_groups, fused.param_groups[0]["tag"]
        ('FusedAdamW', True, 'all')
    """
    counterpart = counterpart_of(type(opt))
    if counterpart is None:
        raise TypeError(f"swap_optimizer: {type(opt).__name__} has no fused counterpart in "
                        "trainfuse.optim.registry")
    cls = counterpart.fused_class
    kwargs = {k: v for k, v in opt.defaults.items() if k in _accepted(cls)}
    missing = [k for k in counterpart.attributes if not hasattr(opt, k)]
    if missing:  # torch's Optimizer.__getstate__ keeps defaults, state and groups only
        names = ", ".join(map(repr, missing))
        raise ValueError(f"swap_optimizer: this {type(opt).__name__} has no attribute {names}, "
                         "which its constructor sets (a copy.deepcopy or pickle of it loses them): swap the "
                         "optimizer as it was built")
    kwargs.update({k: getattr(opt, k) for k in counterpart.attributes})
    new = cls([dict(g) for g in opt.param_groups], **kwargs, max_grad_norm=max_grad_norm,
              max_grad_value=max_grad_value)
    groups = opt.param_groups
    for old, made in zip(groups, new.param_groups):
        for k, v in made.items():  # keys the fused class adds to a group; the user's stay as they are
            old.setdefault(k, v)
    # the group dicts themselves: whoever holds one (a scheduler, the user) changes the new optimizer
    new.param_groups = groups
    new.state.update(opt.state)
    return new


def _repoint(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> bool:
    moved = False
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        moved = True
    for inner in compat.inner_schedulers(scheduler):  # SequentialLR, ChainedScheduler
        moved |= _repoint(inner, old, new)
    return moved


def repoint_schedulers(schedulers: Iterable[Any], old: torch.optim.Optimizer,
                       new: torch.optim.Optimizer) -> int:
    """Point every scheduler in ``schedulers`` that drives ``old`` (and the schedulers inside a
    SequentialLR or ChainedScheduler) at ``new``. Returns how many of ``schedulers`` moved."""
    moved = sum(_repoint(s, old, new) for s in schedulers)
    if moved:
        compat.mark_step_for_schedulers(new)
    return moved


__all__ = ["repoint_schedulers", "sparse_grad_params", "swap_optimizer", "why_not_swappable"]
