r"""FusedAdam and FusedAdamW: torch.optim.Adam/AdamW in one multi-tensor launch.

For each param :math:`\theta` with gradient :math:`g` at step :math:`t` (maximize negates
:math:`g`; ``grad_scale`` from GradScaler divides it first):

.. math::
    g &\leftarrow g + \lambda\theta \quad\text{(Adam, L2 decay)} \qquad
    \theta \leftarrow \theta(1 - \gamma\lambda) \quad\text{(AdamW, decoupled decay)} \\
    m &\leftarrow \mathrm{lerp}(m, g, 1-\beta_1) \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2
    \qquad \hat v = \max(\hat v, v) \text{ if amsgrad} \\
    \theta &\leftarrow \theta - \frac{\gamma}{1-\beta_1^t}\,
    \frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}

Elementwise math is float32 with IEEE division and square root (as torch's CUDA kernels), except
on float32 masters of 16-bit params (``master_weights``, :func:`trainfuse.amp.fuse_casts`), which
torch has no counterpart of: there both are the 2-ulp approximations (1-2 ulp of float32 in the
update, far below the 16-bit rounding of the weight the model reads), which keeps that
16-bit-stream kernel memory-bound. The per-step scalars (bias corrections, step size) are float64
as in torch. States are stored in the param's dtype, like torch.optim. This file holds the kernel,
the optimizer classes and the torch reference path (torch.optim's own functional Adam/AdamW, so
CPU results are identical to torch).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch.optim.adam import adam as _torch_adam
from torch.optim.adamw import adamw as _torch_adamw

from trainfuse._multi_tensor import kernels as mt
from trainfuse.optim._base import FusedOptimizer, _as_float, scalar

# hyperparameter row: lr, beta1, beta2, eps, weight_decay, maximize, amsgrad, decoupled
_LR, _B1, _B2, _EPS, _WD, _MAX, _AMS, _DEC = (tl.constexpr(k) for k in range(8))


@triton.jit
def _adam_chunk(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT: tl.constexpr,
                STATE_DT: tl.constexpr, EMA_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr,
                BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr,
                ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
                WIDTH: tl.constexpr):
    """One work item of Adam/AdamW (the chunk-function contract of ``kernels.run``), its blocks
    unrolled."""
    _adam_update(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT, STATE_DT, EMA_DT, MASTER, EMA,
                 BLOCK, NB, MASKED, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH, False)


@triton.jit
def _adam_chunk_rolled(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT: tl.constexpr,
                       STATE_DT: tl.constexpr, EMA_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr,
                       BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr,
                       ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
                       WIDTH: tl.constexpr):
    """:func:`_adam_chunk` with its blocks in a rolled loop (:data:`ROLLED`)."""
    _adam_update(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT, STATE_DT, EMA_DT, MASTER, EMA,
                 BLOCK, NB, MASKED, ALIGNED, HAS_SCALE, HAS_CLIP, WIDTH, True)


@triton.jit
def _adam_update(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT: tl.constexpr,
                 STATE_DT: tl.constexpr, EMA_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr,
                 BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr,
                 ALIGNED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
                 WIDTH: tl.constexpr, ROLLED: tl.constexpr):
    hp_row = mt.hparams_row(hp, row, WIDTH)
    amsgrad = tl.load(hp_row + _AMS) != 0.0
    offs = tl.arange(0, BLOCK)
    # vector accesses (the 16-byte alignment hint) measured faster for 16-bit streams (GPT-2 bf16
    # with masters 0.883 ms against 0.95 scalar, H200; without masters see FAST below) but slower
    # for plain float32 AdamW (0.959 against 0.908): those rows keep scalar accesses
    VEC: tl.constexpr = ALIGNED and PARAM_DT != tl.float32
    # 2-ulp division and square root where the stored result is 16 bits (masters' 16-bit copy, or
    # 16-bit params and states): IEEE's take ~20 instructions plus a slow path, which made bf16
    # GPT-2 AdamW compute-bound (H100: 0.820 ms, 71 % of the floor, against 0.663 and 87 %). The
    # stored value differs from the IEEE one only where float32's last bits decide a 16-bit
    # rounding: at most one 16-bit ulp, on rare elements
    FAST: tl.constexpr = PARAM_DT != tl.float32
    w_ptr, p_ptr = mt.weight_ptrs(row, start, PARAM_DT, MASTER, VEC)
    g_ptr = mt.operand(row, mt.OP_GRAD, start, PARAM_DT, VEC)
    e_ptr = mt.operand(row, mt.OP_EMA, start, EMA_DT, VEC)
    m_ptr = mt.operand(row, mt.OP_STATE, start, STATE_DT, VEC)
    v_ptr = mt.operand(row, mt.OP_STATE + 1, start, STATE_DT, VEC)
    vmax_ptr = mt.operand(row, mt.OP_STATE + 2, start, STATE_DT, VEC)
    # block 0's loads first: the step, hyperparameter and bias-correction work overlaps them
    p = mt.load(w_ptr, offs, n, MASKED)
    g = mt.load(g_ptr, offs, n, MASKED)
    m = mt.load(m_ptr, offs, n, MASKED)
    v = mt.load(v_ptr, offs, n, MASKED)
    vmax = mt.load_if(vmax_ptr, offs, n, amsgrad, MASKED)
    e = mt.load_opt(e_ptr, offs, n, EMA, MASKED)

    step = mt.advance_step(row, r, arrivals).to(tl.float64)
    lr = tl.load(hp_row + _LR)
    beta1 = tl.load(hp_row + _B1)
    beta2 = tl.load(hp_row + _B2)
    eps = tl.load(hp_row + _EPS).to(tl.float32)
    wd = tl.load(hp_row + _WD)
    maximize = tl.load(hp_row + _MAX) != 0.0
    decoupled = tl.load(hp_row + _DEC) != 0.0
    step_size = (lr / (1.0 - mt.pow_f64(beta1, step))).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - mt.pow_f64(beta2, step)).to(tl.float32)
    w1 = (1.0 - beta1).to(tl.float32)
    w2 = (1.0 - beta2).to(tl.float32)
    b2 = beta2.to(tl.float32)
    # AdamW scales the param, Adam adds wd * param to the grad (only where wd != 0, so an inf
    # param does not turn the grad into 0 * inf = NaN)
    decay = tl.where(decoupled, 1.0 - lr * wd, 1.0).to(tl.float32)
    l2 = tl.where(decoupled, 0.0, wd).to(tl.float32)

    if ROLLED:  # a loop ptxas cannot hoist the later blocks' loads out of: each turn carries one
        for b in range(NB - 1):
            o = offs + b * BLOCK
            o_next = o + BLOCK
            p_next = mt.load(w_ptr, o_next, n, MASKED)
            g_next = mt.load(g_ptr, o_next, n, MASKED)
            m_next = mt.load(m_ptr, o_next, n, MASKED)
            v_next = mt.load(v_ptr, o_next, n, MASKED)
            vmax_next = mt.load_if(vmax_ptr, o_next, n, amsgrad, MASKED)
            e_next = mt.load_opt(e_ptr, o_next, n, EMA, MASKED)
            _adam_block(w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, e_ptr,
                        o, n, p, g, m, v, vmax, e,
                        scale, clip, maximize, l2, decay, w1, w2, b2, eps, step_size, bc2_sqrt, amsgrad,
                        ema_w, STATE_DT, MASTER, EMA, FAST, MASKED, HAS_SCALE, HAS_CLIP)
            p, g, m, v, vmax, e = p_next, g_next, m_next, v_next, vmax_next, e_next
        _adam_block(w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, e_ptr,
                    offs + (NB - 1) * BLOCK, n, p, g, m, v, vmax, e,
                    scale, clip, maximize, l2, decay, w1, w2, b2, eps, step_size, bc2_sqrt, amsgrad,
                    ema_w, STATE_DT, MASTER, EMA, FAST, MASKED, HAS_SCALE, HAS_CLIP)
    else:
        for b in tl.static_range(NB):
            o = offs + b * BLOCK
            if b + 1 < NB:  # prefetch the next block before this one's math and stores
                o_next = o + BLOCK
                p_next = mt.load(w_ptr, o_next, n, MASKED)
                g_next = mt.load(g_ptr, o_next, n, MASKED)
                m_next = mt.load(m_ptr, o_next, n, MASKED)
                v_next = mt.load(v_ptr, o_next, n, MASKED)
                vmax_next = mt.load_if(vmax_ptr, o_next, n, amsgrad, MASKED)
                e_next = mt.load_opt(e_ptr, o_next, n, EMA, MASKED)
            _adam_block(w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, e_ptr,
                        o, n, p, g, m, v, vmax, e,
                        scale, clip, maximize, l2, decay, w1, w2, b2, eps, step_size, bc2_sqrt, amsgrad,
                        ema_w, STATE_DT, MASTER, EMA, FAST, MASKED, HAS_SCALE, HAS_CLIP)
            if b + 1 < NB:
                p, g, m, v, vmax, e = p_next, g_next, m_next, v_next, vmax_next, e_next


@triton.jit
def _adam_block(w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, e_ptr, o, n, p, g, m, v, vmax, e, scale, clip,
                maximize, l2, decay, w1, w2, b2, eps, step_size, bc2_sqrt, amsgrad, ema_w,
                STATE_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr, FAST: tl.constexpr,
                MASKED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr):
    """One block's update from its loaded values, and its stores."""
    g = mt.grad_in(g_ptr, o, n, g, scale, clip, maximize, HAS_SCALE, HAS_CLIP, MASKED)
    g = tl.where(l2 != 0.0, g + l2 * p, g)
    p = p * decay
    m = mt.lerp(m, g, w1)
    v = v * b2 + w2 * (g * g)
    vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
    mt.store_if(vmax_ptr, o, n, vmax, amsgrad, MASKED)
    if FAST:
        denom = tl.fdiv(tl.sqrt(tl.where(amsgrad, vmax, v)), bc2_sqrt) + eps
        p = p - step_size * tl.fdiv(m, denom)
    else:
        denom = tl.div_rn(tl.sqrt_rn(tl.where(amsgrad, vmax, v)), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
    mt.store_weight(w_ptr, p_ptr, o, n, p, MASTER, MASKED)
    mt.ema_fold(e_ptr, o, n, e, p, ema_w, STATE_DT, EMA, MASKED)
    mt.store(m_ptr, o, n, m, MASKED)
    mt.store(v_ptr, o, n, v, MASKED)


# TRAINFUSE_ADAM_ROLLED=1 (opt-in, for tuning): the update's blocks in a rolled loop with 16-bit rows'
# blocks doubled (16-byte accesses). Compiled for sm_90, bf16 AdamW at 512 x 8 x 4 holds 144
# registers that way, against 240 with the blocks unrolled and doubled (no spill either way) and
# 92 unrolled at single width (8-byte accesses); not yet timed on a GPU
ROLLED = os.environ.get("TRAINFUSE_ADAM_ROLLED", "0") == "1"


class FusedAdam(FusedOptimizer):
    """Drop-in ``torch.optim.Adam``: same arguments, defaults, param groups and state_dict.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate, a float or a 1-element tensor (a CUDA tensor is read on the device, so
            a step can be captured in a CUDA graph and the lr changed in place between replays).
        betas: coefficients for the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: L2 penalty (decoupled, as in AdamW, when ``decoupled_weight_decay``).
        amsgrad: use the running maximum of the second moment.
        maximize: maximize the objective instead of minimizing.
        foreach, capturable, differentiable, fused: accepted for torch compatibility and kept in
            the param groups (torch's state_dict layout); ``differentiable=True`` is not supported.
            The CUDA path is always fused and capturable, whatever a group's ``capturable`` says:
            the class attribute :attr:`~trainfuse.optim.FusedOptimizer.capturable` (True) is what
            states that a step can be captured in a CUDA graph.
        decoupled_weight_decay: AdamW's weight decay.
        master_weights: keep a float32 master (and float32 states) for each bfloat16/float16
            param: the update runs on the master and writes the 16-bit param the next forward
            reads, in the same kernel (see :func:`trainfuse.amp.fuse_casts`). A group option.
        max_grad_norm: clip the gradients to this global 2-norm inside the step (torch's
            ``clip_grad_norm_`` semantics, of the unscaled gradients under GradScaler): one
            statistics pass plus the update, no host sync. The norm is ``optimizer.grad_norm``.
        max_grad_value: clamp every gradient element to ``[-max_grad_value, max_grad_value]``
            inside the step (torch's ``clip_grad_value_`` semantics, of the unscaled gradients
            under GradScaler; NaN stays NaN): the update kernel clamps, no extra launch. The
            clipped gradients are left in ``.grad``. At most one of the two clippings.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedAdam(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
    """

    chunk_fn = _adam_chunk_rolled if ROLLED else _adam_chunk
    # every value a step reads can live in device memory (lr, betas... in the hyperparameter table,
    # step counters on the device): a step captured in a CUDA graph replays. Not the constructor's
    # ``capturable``, torch's per-group request, which the kernels do not need
    capturable = True
    # 16-bit blocks stay single width: with five operands prefetched, doubled blocks made bf16
    # GPT-2 AdamW 1.36 ms instead of 0.90 on the H100 (register pressure); the rolled loop's are
    # doubled (ROLLED)
    wide16 = ROLLED

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
    ):
        if differentiable:
            raise RuntimeError(f"{type(self).__name__} does not support differentiable=True")
        defaults = {
            "lr": scalar(lr, "lr"),
            "betas": (_as_float(betas[0]), _as_float(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        if master_weights:  # a group key only when used: default state_dicts stay torch's layout
            defaults["master_weights"] = True
        super().__init__(params, defaults, max_grad_norm, max_grad_value)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", isinstance(self, FusedAdamW))

    def validate_group(self, group: dict[str, Any]) -> None:
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu":
            if not 0.0 <= float(lr):
                raise ValueError(f"Invalid learning rate: {float(lr)}")
        if not 0.0 <= group["eps"]:
            raise ValueError(f"Invalid epsilon value: {group['eps']}")
        for k in (0, 1):
            if not 0.0 <= group["betas"][k] < 1.0:
                raise ValueError(f"Invalid beta parameter at index {k}: {group['betas'][k]}")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")

    def state_keys(self, group):
        if group["amsgrad"]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def init_state(self, p, group, state, like):
        if group["amsgrad"] and "exp_avg" in state and state.get("max_exp_avg_sq") is None:
            raise KeyError(
                f"{type(self).__name__}: amsgrad is on but a param of shape {tuple(p.shape)} has "
                "state without 'max_exp_avg_sq' (amsgrad was turned on after it had state); "
                "torch.optim raises this KeyError too. Set amsgrad when creating the optimizer, "
                "or clear that param's state first")
        state.setdefault("step", 0.0)  # made a tensor by step_tensor, first key as in torch
        for k in self.state_keys(group):
            if state.get(k) is None:
                state[k] = torch.zeros_like(like, memory_format=torch.preserve_format)

    def step_tensor(self, p, state, kernels):
        step = self._conform_step(state.get("step", 0.0), p, kernels)
        state["step"] = step
        return step

    def hparams_row(self, group):
        beta1, beta2 = group["betas"]
        return [group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                float(group["maximize"]), float(group["amsgrad"]),
                float(group["decoupled_weight_decay"])]

    def torch_group_step(self, group, params, grads, weights):
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
        for p in params:
            states, step, _ = self.prepare_state(p, group, kernels=False)
            exp_avgs.append(states[0])
            exp_avg_sqs.append(states[1])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(states[2])
            steps.append(step)
        fn = _torch_adamw if group["decoupled_weight_decay"] else _torch_adam
        beta1, beta2 = group["betas"]
        fn(weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
           foreach=group["foreach"], capturable=False, differentiable=False, fused=None,
           amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
           weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


class FusedAdamW(FusedAdam):
    """Drop-in ``torch.optim.AdamW`` (Adam with decoupled weight decay, default 1e-2).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
    """

    # torch's AdamW is its Adam with this group key; a swap keeps groups that carry it
    IMPLIED_OPTIONS = {"decoupled_weight_decay": True}

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights,
                         max_grad_norm=max_grad_norm, max_grad_value=max_grad_value)


__all__ = ["FusedAdam", "FusedAdamW"]
