"""The torch path of the step driver: torch.optim's own functional update on each group, which CPU
tensors take by default and ``TRAINFUSE_BACKEND=torch`` everywhere."""

from __future__ import annotations

import torch

from trainfuse.optim.contract import OptimizerClient
from trainfuse.optim.dtensors import locals_of
from trainfuse.optim.index import ParamIndex
from trainfuse.optim.sharded import check_group, global_norm


def torch_step(client: OptimizerClient, index: ParamIndex, device: torch.device, idx, grads: list,
               grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
               group=None) -> torch.Tensor | None:
    """One step of ``client`` over ``index.params[i]`` for ``i`` in ``idx`` (all on ``device``;
    ``grads`` aligned with ``index.params``), validated first, as the kernels would do it:
    unscaled by ``grad_scale``, skipped on ``found_inf``, clipped (by the norm of every rank's
    grads where they are sharded over ``group``), on float32 masters where a param has one, then
    the attached EMA moved toward the new weights. DTensor params are unscaled and clipped on
    their local shards and stepped as DTensors (torch.optim's own way).

    Returns:
        The total gradient norm it clipped with (``max_grad_norm``), or None.
    """
    index.validate(client, grads, kernels=False)
    skip = found_inf is not None and float(found_inf) != 0.0  # the reference path may sync
    groups = client.param_groups
    params, group_of = index.params, index.group_of
    by_group: dict[int, tuple[list, list]] = {}
    all_grads, with_grad = [], []
    for i in idx:
        g = grads[i]
        if g is None:
            continue
        ps, gs = by_group.setdefault(group_of[i], ([], []))
        ps.append(params[i])
        gs.append(g)
        all_grads.append(g)
        with_grad.append(params[i])
    total = None
    with torch.no_grad():
        if not skip:
            if grad_scale is not None and all_grads:  # like torch's fused kernels, leave the
                torch._foreach_div_(locals_of(all_grads), grad_scale.to(device))  # grads unscaled
            if client.max_grad_norm is not None and group is not None:  # every rank joins the all-reduce
                check_group(group, type(client).__name__)
                local_grads = locals_of(all_grads)
                total = global_norm(local_grads, 2.0, group, device)  # every rank's shards
                if local_grads:  # torch's clip_grads_with_norm_, on the local shards
                    coef = torch.clamp(client.max_grad_norm / (total + 1e-6), max=1.0)
                    torch._foreach_mul_(local_grads, coef)
            elif client.max_grad_norm is not None and all_grads:
                # torch's function takes the params and clips their .grad
                total = torch.nn.utils.clip_grad_norm_(with_grad, client.max_grad_norm)
            elif client.max_grad_value is not None and all_grads:
                torch.nn.utils.clip_grad_value_(with_grad, client.max_grad_value)
            for gi, (ps, gs) in by_group.items():
                masters = [client.master_of(p, groups[gi]) for p in ps]
                if any(m is not None for m in masters):  # float32 math on the masters
                    ws = [p if m is None else m for p, m in zip(ps, masters)]
                    gs32 = [g if m is None else g.float() for g, m in zip(gs, masters)]
                    client.torch_group_step(groups[gi], ps, gs32, ws)
                    for p, m in zip(ps, masters):
                        if m is not None:
                            p.copy_(m)
                else:
                    client.torch_group_step(groups[gi], ps, gs, ps)
        ema_w = client.ema_weight
        if ema_w is not None:
            # as the kernel: toward a param's float32 master where it has one, in the EMA's dtype
            group_of_param = {id(p): groups[group_of[i]] for i, p in enumerate(params)}
            ema, src = [], []
            for e, t in client.ema_pairs(device):
                group = group_of_param.get(id(t))
                master = None if group is None else client.master_of(t, group)
                t = t if master is None else master
                ema.append(e)
                src.append(t if t.dtype == e.dtype else t.to(e.dtype))
            if ema:
                torch._foreach_lerp_(ema, src, ema_w)
    return total


__all__ = ["torch_step"]
