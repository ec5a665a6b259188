r"""FusedSGD: torch.optim.SGD (momentum, dampening, Nesterov, weight decay) in one launch.

For each param :math:`\theta` with gradient :math:`g` (maximize negates :math:`g`; GradScaler's
``grad_scale`` divides it first):

.. math::
    g &\leftarrow g + \lambda\theta \\
    b &\leftarrow g \ \text{(first step)}, \qquad b \leftarrow \mu b + (1-\tau) g \ \text{(after)} \\
    g &\leftarrow g + \mu b \ \text{(Nesterov)} \quad\text{or}\quad g \leftarrow b \\
    \theta &\leftarrow \theta - \gamma g

The state_dict holds ``momentum_buffer`` per param exactly as torch.optim.SGD (no ``step``). The
kernel needs to know a buffer's first step on the device (GradScaler may skip it), so the engine
keeps a private float32 counter per param, outside the state_dict.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch.optim.sgd import sgd as _torch_sgd

from trainfuse._multi_tensor import kernels as mt
from trainfuse.optim._base import FusedOptimizer, scalar

# hyperparameter row: lr, momentum, dampening, weight_decay, nesterov, maximize
_LR, _MOM, _DAMP, _WD, _NEST, _MAX = (tl.constexpr(k) for k in range(6))


@triton.jit
def _sgd_chunk(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT: tl.constexpr,
               STATE_DT: tl.constexpr, EMA_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr,
               BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
               HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, WIDTH: tl.constexpr):
    hp_row = mt.hparams_row(hp, row, WIDTH)
    momentum = tl.load(hp_row + _MOM)
    offs = tl.arange(0, BLOCK)
    w_ptr, p_ptr = mt.weight_ptrs(row, start, PARAM_DT, MASTER, ALIGNED)
    g_ptr = mt.operand(row, mt.OP_GRAD, start, PARAM_DT, ALIGNED)
    e_ptr = mt.operand(row, mt.OP_EMA, start, EMA_DT, ALIGNED)
    b_ptr = mt.operand(row, mt.OP_STATE, start, STATE_DT, ALIGNED)
    p = mt.load(w_ptr, offs, n, MASKED)
    g = mt.load(g_ptr, offs, n, MASKED)
    e = mt.load_opt(e_ptr, offs, n, EMA, MASKED)

    # the first step writes the buffer without reading it (torch clones the gradient)
    first = mt.advance_step(row, r, arrivals) == 1.0
    has_buf = momentum != 0.0
    read_buf = has_buf & (first == 0)
    buf = mt.load_if(b_ptr, offs, n, read_buf, MASKED)
    lr = tl.load(hp_row + _LR).to(tl.float32)
    dampening = tl.load(hp_row + _DAMP)
    wd = tl.load(hp_row + _WD).to(tl.float32)
    nesterov = tl.load(hp_row + _NEST) != 0.0
    maximize = tl.load(hp_row + _MAX) != 0.0
    mu = momentum.to(tl.float32)
    damp = tl.where(first, 1.0, 1.0 - dampening).to(tl.float32)
    mu_buf = tl.where(first, 0.0, mu)

    for b in tl.static_range(NB):
        o = offs + b * BLOCK
        if b + 1 < NB:  # prefetch the next block before this one's math and stores
            o_next = o + BLOCK
            p_next = mt.load(w_ptr, o_next, n, MASKED)
            g_next = mt.load(g_ptr, o_next, n, MASKED)
            buf_next = mt.load_if(b_ptr, o_next, n, read_buf, MASKED)
            e_next = mt.load_opt(e_ptr, o_next, n, EMA, MASKED)
        g = mt.grad_in(g_ptr, o, n, g, scale, clip, maximize, HAS_SCALE, HAS_CLIP, MASKED)
        g = tl.where(wd != 0.0, g + wd * p, g)
        buf = buf * mu_buf + damp * g  # first step: 0 * 0 + 1 * g, exactly g
        mt.store_if(b_ptr, o, n, buf, has_buf, MASKED)
        g = tl.where(has_buf, tl.where(nesterov, g + mu * buf, buf), g)
        p = p - lr * g
        mt.store_weight(w_ptr, p_ptr, o, n, p, MASTER, MASKED)
        mt.ema_fold(e_ptr, o, n, e, p, ema_w, STATE_DT, EMA, MASKED)
        if b + 1 < NB:
            p, g, buf, e = p_next, g_next, buf_next, e_next


class FusedSGD(FusedOptimizer):
    """Drop-in ``torch.optim.SGD``: same arguments, defaults, param groups and state_dict.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate (float or 1-element tensor, see :class:`FusedAdam`).
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and zero dampening).
        maximize: maximize the objective instead of minimizing.
        foreach, differentiable, fused: accepted for torch compatibility.
        master_weights, max_grad_norm, max_grad_value: as in :class:`trainfuse.optim.FusedAdam`.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedSGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
    """

    chunk_fn = _sgd_chunk
    capturable = True  # every value a step reads can live in device memory: a captured step replays
    wide16 = True  # 16-bit rows in blocks twice as long: 16-byte accesses per thread

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
    ):
        if differentiable:
            raise RuntimeError(f"{type(self).__name__} does not support differentiable=True")
        # torch checks this once, here: a schedule or warmup that later writes momentum 0 into a
        # nesterov group steps as plain SGD (the update ignores nesterov without momentum)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = {
            "lr": scalar(lr, "lr"),
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
            "differentiable": differentiable,
            "fused": fused,
        }
        if master_weights:  # a group key only when used: default state_dicts stay torch's layout
            defaults["master_weights"] = True
        self._counters: dict[torch.Tensor, torch.Tensor] = {}
        super().__init__(params, defaults, max_grad_norm, max_grad_value)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._counters = {}
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._counters = {}

    def validate_group(self, group):
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu":
            if float(lr) < 0.0:
                raise ValueError(f"Invalid learning rate: {float(lr)}")
        if group["momentum"] < 0.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']}")
        if group["weight_decay"] < 0.0:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")

    def state_keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def init_state(self, p, group, state, like):
        # contents are irrelevant: a counter of 0 makes the first step write the gradient
        state["momentum_buffer"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        self._counters[p] = self._new_step(p, True, 0.0)

    def step_tensor(self, p, state, kernels):
        counter = self._counters.get(p)
        if counter is None:  # a loaded buffer, or one the torch path made, holds real data
            started = state.get("momentum_buffer") is not None
            counter = self._new_step(p, True, 1.0 if started else 0.0)
        elif counter.device != p.device:
            counter = counter.to(p.device)
        self._counters[p] = counter
        return counter

    def hparams_row(self, group):
        return [group["lr"], group["momentum"], group["dampening"], group["weight_decay"],
                float(group["nesterov"]), float(group["maximize"])]

    def torch_group_step(self, group, params, grads, weights):
        bufs = [self.state[p].get("momentum_buffer") for p in params]
        _torch_sgd(weights, grads, bufs, has_sparse_grad=False, foreach=group["foreach"],
                   fused=None, weight_decay=group["weight_decay"], momentum=group["momentum"],
                   lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
                   maximize=group["maximize"])
        if group["momentum"] != 0:
            for p, buf in zip(params, bufs):
                self.state[p]["momentum_buffer"] = buf
                self._counters.pop(p, None)


__all__ = ["FusedSGD"]
