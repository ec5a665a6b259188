"""Swapping torch.optim.AdamW/Adam/SGD for their fused counterparts inside a running Trainer.

The new optimizer holds the old one's param-group dicts themselves (same Parameter objects in the
same order, every key kept, the user's own included) and its state, so it continues exactly where
the old one stopped; every LR scheduler that drove the old one is pointed at the new one.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch

from trainfuse.optim import FusedAdam, FusedAdamW, FusedSGD

FUSED: dict[type, type] = {torch.optim.AdamW: FusedAdamW, torch.optim.Adam: FusedAdam,
                           torch.optim.SGD: FusedSGD}
# constructor options the fused classes set themselves
_OWN = {"params", "master_weights", "max_grad_norm", "max_grad_value"}
# AdamW's group key that FusedAdamW implies (it has no such argument)
_IMPLIED = {FusedAdamW: {"decoupled_weight_decay": True}}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _accepted(cls: type) -> set[str]:
    return set(inspect.signature(cls).parameters) - _OWN


def why_not_swappable(opt: torch.optim.Optimizer, kernels: bool) -> str | None:
    """Why ``opt`` must stay as it is, or None when :func:`swap_optimizer` can replace it.

    Args:
        opt: the optimizer configure_optimizers returned.
        kernels: whether its params take the Triton kernels (their dtypes then matter).
    """
    cls = FUSED.get(type(opt))
    if cls is None:
        return (f"{type(opt).__name__} has no fused counterpart (exactly torch.optim.AdamW, Adam and SGD "
                "are swapped)")
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return "it has step hooks (register_step_pre_hook/post_hook), which belong to that object"
    implied = _IMPLIED.get(cls, {})
    unknown = sorted(k for k in opt.defaults if k not in _accepted(cls) and k not in implied)
    if unknown:
        return f"option {unknown[0]}={opt.defaults[unknown[0]]!r} has no {cls.__name__} counterpart"
    for gi, group in enumerate(opt.param_groups):
        if group.get("differentiable"):
            return f"param group {gi}: differentiable=True (the fused step is not differentiable)"
        for k, v in implied.items():
            if group.get(k, v) != v:
                return f"param group {gi}: {k}={group[k]!r} ({cls.__name__} implies {k}={v})"
        for p in group["params"]:
            if p.is_complex():
                return f"param group {gi}: complex param of shape {tuple(p.shape)}"
            if kernels and p.dtype not in _KERNEL_DTYPES:
                return f"param group {gi}: {p.dtype} param (the kernels take float32, bfloat16, float16)"
    return None


def swap_optimizer(opt: torch.optim.Optimizer, max_grad_norm: float | None,
                   max_grad_value: float | None = None) -> torch.optim.Optimizer:
    """The fused optimizer that continues ``opt``: its group dicts and list, its state.

    Args:
        opt: a torch.optim.AdamW, Adam or SGD (checked by :func:`why_not_swappable`).
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
    cls = FUSED[type(opt)]
    kwargs = {k: v for k, v in opt.defaults.items() if k in _accepted(cls)}
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
    for inner in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        moved |= _repoint(inner, old, new)
    return moved


def _track_step(opt: torch.optim.Optimizer) -> None:
    """Mark ``opt.step`` as torch's LR schedulers mark the optimizers they are built on (they warn
    on their first step when the optimizer's step lacks the mark); the same one-call wrapper."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    func = type(opt).step
    ref = weakref.ref(opt)

    @functools.wraps(func)
    def step(*args, **kwargs):
        this = ref()
        this._opt_called = True
        return func(this, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    opt.step = step


def repoint_schedulers(configs: list[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> int:
    """Point every LR scheduler config's scheduler (and the schedulers inside SequentialLR or
    ChainedScheduler) that drives ``old`` at ``new``. Returns how many configs moved."""
    moved = sum(_repoint(cfg.scheduler, old, new) for cfg in configs)
    if moved:
        _track_step(new)
    return moved


__all__ = ["FUSED", "repoint_schedulers", "swap_optimizer", "why_not_swappable"]
