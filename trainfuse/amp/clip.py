"""Fused gradient clipping: torch.nn.utils.clip_grad_norm_ as two multi-tensor launches.

The first launch reads every gradient once and produces the global norm, the clip coefficient
``min(max_norm / (norm + 1e-6), 1)`` and an inf/NaN flag (``grad_stats_kernel``: per-chunk
partials reduced by the last program in a fixed order, so the result is deterministic); the second
multiplies the gradients by the coefficient, read from the device (no host sync). Inside a fused
optimizer (``max_grad_norm=``) the second pass is the update itself.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from typing import Any

import torch
import triton
import triton.language as tl

from trainfuse._multi_tensor import kernels as mt
from trainfuse._multi_tensor.tables import (
    DTYPE_CODES,
    NORM_KINDS,
    OP_GRAD,
    RowBuilder,
    TensorListPlans,
    code_of,
    is_dense,
    launch_stats,
    launch_update,
)
from trainfuse._runtime.backend import use_triton
from trainfuse.optim.sharded import combine_stats_, global_norm

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_dtype = operator.attrgetter("dtype")
_plans = TensorListPlans()


@triton.jit
def _scale_chunk(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT: tl.constexpr,
                 STATE_DT: tl.constexpr, EMA_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr,
                 BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr,
                 ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
                 WIDTH: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    g_ptr = mt.operand(row, mt.OP_GRAD, start, PARAM_DT, ALIGNED)
    g = mt.load(g_ptr, offs, n, MASKED)
    for b in tl.static_range(NB):
        o = offs + b * BLOCK
        if b + 1 < NB:
            g_next = mt.load(g_ptr, o + BLOCK, n, MASKED)
        mt.grad_in(g_ptr, o, n, g, scale, clip, False, HAS_SCALE, HAS_CLIP, MASKED)
        if b + 1 < NB:
            g = g_next


def _grads_plan(grads: list[torch.Tensor], norm_type: float):
    """The cached plan for these grads, or None where torch's function must run (backend, norm
    type, device or dtype the kernels do not take). The backend comes first, so the torch path
    builds no tables. Checked once per list; later calls only compare addresses, sizes and dtypes
    (a few microseconds for hundreds of tensors)."""
    device = grads[0].device
    if norm_type not in NORM_KINDS or not use_triton(device):
        return None
    try:
        key = (device, *map(_data_ptr, grads), *map(_numel, grads), *map(_dtype, grads))
    except RuntimeError:  # sparse grads have no data pointer
        return None
    plan = _plans.lookup(key)
    if plan is None:
        for g in grads:
            if (g.device != device or g.layout != torch.strided or g.dtype not in DTYPE_CODES
                    or not is_dense(g)):
                return None
        builder = RowBuilder()
        for g in grads:
            builder.add({OP_GRAD: g}, g.numel(), code_of(g.dtype))
        plan = _plans.get(key, lambda: builder.build(device))
    return plan


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: Any = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` in two launches (norm, then scaling), no host sync.

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` are clipped in place.
        max_norm: the largest total norm allowed.
        norm_type: 2, 1 or inf take the kernels; other norms (and grads on several devices or
            of other dtypes) run torch's own function.
        error_if_nonfinite: raise when the total norm is inf/NaN (this one syncs, as in torch).
        foreach: accepted for torch compatibility.
        process_group: where the ranks of this process group each hold some of the gradients
            (FSDP's shards), the norm is that of all of them: one all-reduce on the device, no
            host sync (None: this process's gradients alone, as torch's function).

    Returns:
        The total norm of the gradients (viewed as one vector), in the dtype torch's function
        returns: the gradients' dtype, promoted across dtypes when they differ (torch stacks the
        per-tensor norms), e.g. float32 for bfloat16 and float32 gradients.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 2)
        >>> layer(torch.randn(3, 4)).sum().backward()
        >>> norm = clip_grad_norm_(layer.parameters(), max_norm=0.1)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    plan = _grads_plan(grads, norm_type) if grads else None
    if plan is None and process_group is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if plan is None:  # torch's functions for this rank's part, then the group's norm
        total = global_norm(grads, norm_type, process_group)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped")
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach)
        return total
    out = torch.empty(4, dtype=torch.float32, device=grads[0].device)
    with torch.no_grad():
        launch_stats(_plans.launcher, plan, out, max_norm=float(max_norm), norm_type=norm_type)
        if process_group is not None:
            combine_stats_(out, process_group, float(max_norm), norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(out[0])):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        launch_update(_plans.launcher, _scale_chunk, plan, wide16=True, clip=out[1:2])
    total = out[0]
    dtype = functools.reduce(torch.promote_types, set(map(_dtype, grads)))
    return total if dtype == torch.float32 else total.to(dtype)


__all__ = ["clip_grad_norm_"]
