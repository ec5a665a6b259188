"""A fused optimizer's multi-tensor plan for one device: a row per param with a gradient (param,
grad, float32 master, EMA tensor, states, step counter), then a row per EMA pair whose model
tensor has no such row (buffers, frozen params). The plan cache (:mod:`trainfuse.optim.plans`)
keeps what this builds and checks its addresses before each launch."""

from __future__ import annotations

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
from trainfuse.optim.contract import OptimizerClient
from trainfuse.optim.dtensors import local
from trainfuse.optim.index import ParamIndex


def build_plan(client: OptimizerClient, index: ParamIndex, device: torch.device,
               grads: list[torch.Tensor | None]) -> Plan:
    """The plan of ``client`` (the optimizer) over its params on ``device`` (``index``'s), with
    ``grads`` aligned with ``index.params``. It keeps alive the storage of every tensor a row
    addresses, grads aside (the plan cache compares their addresses); a grad laid out unlike its
    param goes through a conformed copy (``plan.copy_back``, and the plan is ``volatile``:
    rebuilt every step)."""
    groups = client.param_groups
    params, group_of = index.params, index.group_of
    builder = RowBuilder()
    copy_back, row_params = [], []
    keepalive = []  # conformed grads, and the storage of every tensor a row addresses but grads
    with_row = set()
    for i in index.devices[device]:
        g = grads[i]
        if g is None:
            continue
        states, step, master = client.prepare_state(params[i], groups[group_of[i]], kernels=True)
        # DTensors (FSDP2): the rows address this rank's shards; the states stay DTensors
        p, g, master, ema = local(params[i]), local(g), local(master), local(client.ema_target(params[i]))
        states = [local(t) for t in states]
        keepalive.extend(t.untyped_storage() for t in (p, master, step, *states) if t is not None)
        if not same_layout(g, p):  # e.g. a contiguous grad for a channels_last weight
            tmp = conform(g, p)
            keepalive.append(tmp)
            copy_back.append((g, tmp))
            g = tmp
        if ema is not None:
            keepalive.append(ema.untyped_storage())
        operands = {OP_PARAM: p, OP_GRAD: g, OP_MASTER: master, OP_EMA: ema}
        operands.update({OP_STATE + k: t for k, t in enumerate(states)})
        builder.add(operands, p.numel(), code_of(p.dtype, master is not None, ema), group_of[i], step)
        with_row.add(params[i])
        row_params.append(p)
    for ema, src in client.ema_pairs(device):
        if src not in with_row:  # buffers, frozen params, params without a grad this step
            ema, src = local(ema), local(src)
            keepalive.extend((ema.untyped_storage(), src.untyped_storage()))
            builder.add({OP_PARAM: src, OP_EMA: ema}, src.numel(),
                        code_of(src.dtype, ema=ema, ema_only=True))
    return builder.build(device, keepalive=keepalive, copy_back=copy_back, glayout=grad_layouts(row_params))


__all__ = ["build_plan"]
