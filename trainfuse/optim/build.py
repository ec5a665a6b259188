"""A fused optimizer's multi-tensor plan for one device: a row per param with a gradient (param,
grad, float32 master, EMA tensor, states, step counter), then a row per EMA pair whose model
tensor has no such row (buffers, frozen params). The engine (:mod:`trainfuse.optim.engine`)
caches what this builds and checks its addresses before each launch."""

from __future__ import annotations

from typing import Any

import torch

from trainfuse._multi_tensor.tables import (
    OP_EMA,
    OP_GRAD,
    OP_MASTER,
    OP_PARAM,
    OP_STATE,
    Plan,
    RowBuilder,
    code_of,
    conform,
    grad_layouts,
    same_layout,
)


def build_plan(client: Any, params: list[torch.Tensor], group_of: list[int], device: torch.device,
               idx: list[int] | None, grads: list[torch.Tensor | None]) -> Plan:
    """The plan of ``client`` (the optimizer) over ``params[i]`` for ``i`` in ``idx`` (None: all),
    ``grads`` aligned with ``params`` and ``group_of`` their group indices. It keeps alive the
    storage of every tensor a row addresses, grads aside (the engine compares their addresses);
    a grad laid out unlike its param goes through a conformed copy (``plan.copy_back``, and the
    plan is ``volatile``: rebuilt every step)."""
    groups = client.param_groups
    builder = RowBuilder()
    keepalive, copy_back, slots, row_params = [], [], [], []
    storages = []  # of every tensor a row addresses, grads aside (their addresses are checked)
    volatile = False
    with_row = set()
    for pos, i in enumerate(idx if idx is not None else range(len(params))):
        g = grads[i]
        if g is None:
            continue
        p = params[i]
        states, step, master = client.prepare_state(p, groups[group_of[i]], kernels=True)
        storages.extend(t.untyped_storage() for t in (p, master, step, *states) if t is not None)
        if not same_layout(g, p):  # e.g. a contiguous grad for a channels_last weight
            tmp = conform(g, p)
            keepalive.append(tmp)
            copy_back.append((g, tmp))
            volatile = True
            g = tmp
        ema = client.ema_target(p)
        if ema is not None:
            storages.append(ema.untyped_storage())
        operands = {OP_PARAM: p, OP_GRAD: g, OP_MASTER: master, OP_EMA: ema}
        operands.update({OP_STATE + k: t for k, t in enumerate(states)})
        builder.add(operands, p.numel(), code_of(p.dtype, master is not None, ema), group_of[i], step)
        with_row.add(p)
        slots.append(pos)
        row_params.append(p)
    for ema, src in client.ema_pairs(device):
        if src not in with_row:  # buffers, frozen params, params without a grad this step
            storages.extend((ema.untyped_storage(), src.untyped_storage()))
            builder.add({OP_PARAM: src, OP_EMA: ema}, src.numel(),
                        code_of(src.dtype, ema=ema, ema_only=True))
    plan = builder.build(device)
    plan.keepalive, plan.copy_back, plan.volatile = keepalive + storages, copy_back, volatile
    plan.slots, plan.glayout = slots, grad_layouts(row_params)
    return plan


__all__ = ["build_plan"]
