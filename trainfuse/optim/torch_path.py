"""The torch path of the step driver: torch.optim's own functional update on each group, and the
checks every step makes before it touches a tensor (shared with the kernel path)."""

from __future__ import annotations

import torch

from trainfuse._multi_tensor.tables import DTYPE_CODES, is_dense
from trainfuse._runtime.backend import use_triton
from trainfuse.optim.sharded import check_group, global_norm


class TorchPath:
    """Mixed into :class:`trainfuse.optim.engine.MultiTensorEngine`: validation of params and
    grads (a clear error before anything is modified) and the torch reference step, which CPU
    tensors take by default and ``TRAINFUSE_BACKEND=torch`` everywhere."""

    def _fail(self, i: int, what: str, exc: type[Exception] = ValueError) -> None:
        p = self._params[i]
        raise exc(
            f"{type(self.client).__name__}: param {i} (group {self._group_of[i]}, shape "
            f"{tuple(p.shape)}, {p.dtype}, {p.device}) {what}"
        )

    def validate(self, grads: list[torch.Tensor | None], kernels: bool) -> None:
        """Raise a clear error for the first unusable param/grad, before anything is modified."""
        self.client.check_clipping()
        if self.client.max_grad_norm is not None and not self._single and self._params:
            raise ValueError(f"{type(self.client).__name__}: max_grad_norm needs all params on one "
                             f"device, found {', '.join(map(str, self._devices))}; clip with "
                             "trainfuse.amp.clip_grad_norm_ per device instead")
        for i, (p, g) in enumerate(zip(self._params, grads)):
            if g is None:
                continue
            if g.layout != torch.strided or g.is_sparse:
                self._fail(i, "has a sparse gradient; sparse gradients are not supported "
                              "(use torch.optim.SparseAdam)", RuntimeError)
            if p.is_complex():
                self._fail(i, "is complex; complex params are not supported "
                              "(view them as real with torch.view_as_real)")
            if not p.is_floating_point():
                self._fail(i, "is not floating point")
            if g.dtype != p.dtype:
                self._fail(i, f"has a {g.dtype} gradient; the gradient must have the param's dtype")
            if g.shape != p.shape:
                self._fail(i, f"has a gradient of shape {tuple(g.shape)}; expected the param's shape")
            if g.device != p.device:
                self._fail(i, f"has its gradient on {g.device}; expected the param's device")
            if kernels and use_triton(p.device):
                if p.dtype not in DTYPE_CODES:
                    self._fail(i, "has a dtype the kernels do not take (float32, bfloat16, float16); "
                                  "TRAINFUSE_BACKEND=torch runs the torch path for it", TypeError)
                if not is_dense(p):
                    self._fail(i, "is a view with gaps or overlaps in memory; the fused update "
                                  "works over a param's storage, so pass a dense param")

    def _torch_step(self, device, idx, grads, grad_scale, found_inf) -> None:
        self.validate(grads, kernels=False)
        client = self.client
        skip = found_inf is not None and float(found_inf) != 0.0  # the reference path may sync
        groups = client.param_groups
        by_group: dict[int, tuple[list, list, list]] = {}
        all_grads, with_grad = [], []
        for i in idx:
            g = grads[i]
            if g is None:
                continue
            ps, gs, ms = by_group.setdefault(self._group_of[i], ([], [], []))
            ps.append(self._params[i])
            gs.append(g)
            all_grads.append(g)
            with_grad.append(self._params[i])
        with torch.no_grad():
            if not skip:
                if grad_scale is not None and all_grads:  # like torch's fused kernels, leave the
                    torch._foreach_div_(all_grads, grad_scale.to(device))  # grads unscaled
                if client.max_grad_norm is not None and all_grads and client.shard_group is not None:
                    check_group(client.shard_group, type(client).__name__)
                    total = global_norm(all_grads, 2.0, client.shard_group)  # every rank's shards
                    torch.nn.utils.clip_grads_with_norm_(with_grad, client.max_grad_norm, total)
                    self._stats_out(device)[0].copy_(total)
                    self._norm_ready = True
                elif client.max_grad_norm is not None and all_grads:
                    # torch's function takes the params and clips their .grad
                    total = torch.nn.utils.clip_grad_norm_(with_grad, client.max_grad_norm)
                    self._stats_out(device)[0].copy_(total)
                    self._norm_ready = True
                elif client.max_grad_value is not None and all_grads:
                    torch.nn.utils.clip_grad_value_(with_grad, client.max_grad_value)
                for gi, (ps, gs, _) in by_group.items():
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
                group_of = {id(p): groups[self._group_of[i]] for i, p in enumerate(self._params)}
                ema, src = [], []
                for e, t in client.ema_pairs(device):
                    group = group_of.get(id(t))
                    master = None if group is None else client.master_of(t, group)
                    t = t if master is None else master
                    ema.append(e)
                    src.append(t if t.dtype == e.dtype else t.to(e.dtype))
                if ema:
                    torch._foreach_lerp_(ema, src, ema_w)
