r"""FusedMuon: ``torch.optim.Muon`` on the multi-tensor engine.

For a matrix param :math:`\theta` with gradient :math:`g`, learning rate :math:`\gamma`, weight
decay :math:`\lambda`, momentum :math:`\mu` and the scale :math:`s(\theta)` of ``adjust_lr_fn``:

.. math::
    B &\leftarrow \mathrm{lerp}(B, g, 1 - \mu) \\
    u &\leftarrow \mathrm{lerp}(g, B, \mu) \ \text{(Nesterov)} \quad\text{or}\quad u \leftarrow B \\
    \theta &\leftarrow \theta (1 - \gamma\lambda) - \gamma\, s(\theta)\, \mathrm{NS}_k(u)

:math:`\mathrm{NS}_k` is ``ns_steps`` quintic Newton-Schulz iterations with ``ns_coefficients`` in
bfloat16 on :math:`u` (transposed when it has more rows than columns), normalized by its
Frobenius norm floored at ``eps``; :math:`s` is ``sqrt(max(1, A / B))`` (``"original"``, the
default), ``0.2 sqrt(max(A, B))`` (``"match_rms_adamw"``) or ``sqrt(A / B)``
(``"spectral_unclamped"``) for an ``A x B`` param. The state_dict is Muon's: ``momentum_buffer``.

On the kernels the Newton-Schulz part runs first for all of a group's matrices at once
(:class:`~trainfuse.optim.newton_schulz.BatchedNewtonSchulz`: the momentum and its blend, every
matrix zero-padded into a few bfloat16 batches by size, cuBLAS's batched matmuls, where torch's
Muon orthogonalizes one matrix at a time) and writes :math:`s\,\mathrm{NS}_k(u)` into a private
per-param tensor; one multi-tensor launch then moves the momentum, decays the weights and applies
the update. The padding changes only the order the matmuls sum in: the update is Muon's within
bfloat16 rounding (which the quintic iteration amplifies along small singular directions). The
torch path is Muon's own op sequence, bit for bit.

What differs from ``torch.optim.Muon``: ``lr`` is a number (Muon also takes a one-element tensor).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from trainfuse._multi_tensor import kernels as mt
from trainfuse._multi_tensor.tables import same_layout
from trainfuse._runtime.backend import use_triton
from trainfuse.optim._base import FusedOptimizer
from trainfuse.optim.musgd import MuonEngine
from trainfuse.optim.newton_schulz import BatchedNewtonSchulz

# torch.optim.Muon's defaults (Keller Jordan's coefficients)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
MAX_NS_STEPS = 100  # Muon refuses this many iterations or more
# hyperparameter row: momentum, nesterov, 1 - lr * weight_decay, -lr
_MOM, _NEST, _DECAY, _STEP = (tl.constexpr(k) for k in range(4))


@triton.jit
def _muon_chunk(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT: tl.constexpr,
                STATE_DT: tl.constexpr, EMA_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr,
                BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, WIDTH: tl.constexpr):
    # states: OP_STATE the momentum B, OP_STATE + 1 the orthogonalized, scaled update
    hp_row = mt.hparams_row(hp, row, WIDTH)
    offs = tl.arange(0, BLOCK)
    w_ptr, p_ptr = mt.weight_ptrs(row, start, PARAM_DT, MASTER, ALIGNED)
    g_ptr = mt.operand(row, mt.OP_GRAD, start, PARAM_DT, ALIGNED)
    e_ptr = mt.operand(row, mt.OP_EMA, start, EMA_DT, ALIGNED)
    m_ptr = mt.operand(row, mt.OP_STATE, start, STATE_DT, ALIGNED)
    u_ptr = mt.operand(row, mt.OP_STATE + 1, start, STATE_DT, ALIGNED)
    p = mt.load(w_ptr, offs, n, MASKED)
    g = mt.load(g_ptr, offs, n, MASKED)
    m = mt.load(m_ptr, offs, n, MASKED)
    u = mt.load(u_ptr, offs, n, MASKED)
    e = mt.load_opt(e_ptr, offs, n, EMA, MASKED)
    momentum = tl.load(hp_row + _MOM)
    weight = (1.0 - momentum).to(tl.float32)  # lerp's weight, rounded once as torch passes it
    decay = tl.load(hp_row + _DECAY).to(tl.float32)
    step = tl.load(hp_row + _STEP).to(tl.float32)

    for k in tl.static_range(NB):
        o = offs + k * BLOCK
        if k + 1 < NB:  # prefetch the next block before this one's math and stores
            o_next = o + BLOCK
            p_next = mt.load(w_ptr, o_next, n, MASKED)
            g_next = mt.load(g_ptr, o_next, n, MASKED)
            m_next = mt.load(m_ptr, o_next, n, MASKED)
            u_next = mt.load(u_ptr, o_next, n, MASKED)
            e_next = mt.load_opt(e_ptr, o_next, n, EMA, MASKED)
        g = mt.grad_in(g_ptr, o, n, g, scale, clip, False, HAS_SCALE, HAS_CLIP, MASKED)
        # the momentum the host orthogonalized from, recomputed here so a step GradScaler skips
        # leaves it as it was; torch's lerp formula on each side of weight 0.5
        m = tl.where(weight < 0.5, m + weight * (g - m), g - (g - m) * (1.0 - weight))
        mt.store(m_ptr, o, n, m, MASKED)
        p = p * decay + step * u
        mt.store_weight(w_ptr, p_ptr, o, n, p, MASTER, MASKED)
        mt.ema_fold(e_ptr, o, n, e, p, ema_w, STATE_DT, EMA, MASKED)
        if k + 1 < NB:
            p, g, m, u, e = p_next, g_next, m_next, u_next, e_next


def adjusted_scale(shape: torch.Size, adjust_lr_fn: str | None) -> float:
    """The factor ``adjust_lr_fn`` puts on ``lr`` for a param of ``shape`` (module docstring)."""
    A, B = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    return math.sqrt(A / B)  # spectral_unclamped


def newton_schulz(u: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """``NS_steps(u)`` of one matrix in bfloat16, as ``torch.optim.Muon`` computes it (its ops in
    its order: the torch path's bits are Muon's)."""
    a, b, c = coefficients
    x = u.bfloat16()
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class FusedMuon(FusedOptimizer):
    """Drop-in ``torch.optim.Muon``: same arguments, defaults, param groups and state_dict.

    Args:
        params: iterable of matrix params (2 dims) or param-group dicts.
        lr: learning rate.
        weight_decay: decoupled weight decay (``theta *= 1 - lr * weight_decay``).
        momentum: momentum factor.
        nesterov: Nesterov momentum.
        ns_coefficients: the quintic Newton-Schulz iteration's ``(a, b, c)``.
        eps: the floor of the norm Newton-Schulz divides by.
        ns_steps: Newton-Schulz iterations (fewer than 100).
        adjust_lr_fn: ``None`` or ``"original"``, ``"match_rms_adamw"``, ``"spectral_unclamped"``.
        master_weights, max_grad_norm, max_grad_value: as in :class:`trainfuse.optim.FusedAdam`.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
        >>> opt = FusedMuon(model.parameters(), lr=0.02)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
    """

    chunk_fn = _muon_chunk
    # graph-safe steps read the Newton-Schulz part's momentum from the device table, and the
    # engine's scaled_step runs that part between its statistics pass and the update: the whole
    # step replays from a CUDA graph (its batches those of the params with a grad at capture)
    capturable = True
    wide16 = True

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 master_weights: bool = False, max_grad_norm: float | None = None,
                 max_grad_value: float | None = None):
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr_fn": adjust_lr_fn}
        if master_weights:  # a group key only when used: default state_dicts stay Muon's layout
            defaults["master_weights"] = True
        self._private()
        super().__init__(params, defaults, max_grad_norm, max_grad_value)
        self.engine = MuonEngine(self)

    def _private(self) -> None:
        # param -> its orthogonalized, scaled update, which the update launch reads (not state)
        self._updates: dict[torch.Tensor, torch.Tensor] = {}
        # device -> the step counter every row points at: the update keeps no count
        self._no_step: dict[torch.device, torch.Tensor] = {}
        # (group index, device) -> (what it was made for, the Newton-Schulz plan of its params with
        # a grad on the kernels)
        self._ns_plans: dict[tuple[int, torch.device], tuple[tuple, BatchedNewtonSchulz]] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._private()
        self.engine = MuonEngine(self)

    def validate_group(self, group):
        name = type(self).__name__
        for key in ("lr", "momentum", "weight_decay", "eps"):
            value = group[key]
            if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)) or not value >= 0.0:
                raise ValueError(f"{name}: {key} must be a number >= 0, got {value!r}")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"{name}: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got "
                             f"{group['adjust_lr_fn']!r}")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < MAX_NS_STEPS:
            raise ValueError(f"{name}: ns_steps must be an int in [0, {MAX_NS_STEPS}), got {steps!r}")
        if len(tuple(group["ns_coefficients"])) != 3:
            raise ValueError(f"{name}: ns_coefficients must be three numbers (a, b, c), got "
                             f"{group['ns_coefficients']!r}")
        for k, p in enumerate(group["params"]):
            if p.ndim != 2:
                raise ValueError(f"{name}: param {k} has shape {tuple(p.shape)}; Muon orthogonalizes "
                                 "matrices, so it takes 2-dim params only (give biases, norms and "
                                 "embeddings to AdamW)")

    def state_keys(self, group):
        return ("momentum_buffer",)

    def init_state(self, p, group, state, like):
        if state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(like, memory_format=torch.preserve_format)

    def step_tensor(self, p, state, kernels):
        counter = self._no_step.get(p.device)
        if counter is None:
            counter = self._no_step[p.device] = self._new_step(p, True)
        return counter

    def prepare_state(self, p, group, kernels):
        states, step, master = super().prepare_state(p, group, kernels)
        return [*states, self._update_of(p, p if master is None else master)], step, master

    def _update_of(self, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``p``'s update tensor, laid out like ``like`` (made when missing or unlike it; a
        replaced one drops the plans, which point at the old one)."""
        u = self._updates.get(p)
        if u is not None and u.dtype == like.dtype and u.device == like.device and same_layout(u, like):
            return u
        if u is not None:
            self.engine.invalidate()
        u = self._updates[p] = torch.zeros_like(like, memory_format=torch.preserve_format)
        return u

    def hparams_row(self, group):
        lr = group["lr"]
        return [group["momentum"], float(group["nesterov"]), 1 - lr * group["weight_decay"], -lr]

    def muon_grads(self) -> bool:
        """Whether a param has a grad on the kernels (the step has a Newton-Schulz part)."""
        return any(p.grad is not None and use_triton(p.device) for group in self.param_groups
                   for p in group["params"])

    def orthogonalize_for_kernels(self, grad_scale: torch.Tensor | None, clip: torch.Tensor | None = None
                                  ) -> None:
        """Write ``s * NS(u)`` of every param with a grad on the kernels into its update tensor,
        which the update launch reads; the momentum is read, not written (the launch writes it,
        unless GradScaler skips the step).

        Args:
            grad_scale: GradScaler's scale the grads carry, or None.
            clip: the clip coefficient of ``max_grad_norm`` (a one-element device tensor the
                statistics pass wrote), or None.
        """
        name = type(self).__name__
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None and use_triton(p.device)]
            if not params:
                continue
            if self.max_grad_norm is not None and clip is None:
                raise ValueError(f"{name}: max_grad_norm needs every param on one device; clip the grads "
                                 "before the step instead")
            by_device: dict[torch.device, list] = {}
            for p in params:
                by_device.setdefault(p.device, []).append(p)
            for device, on_device in by_device.items():
                self._orthogonalize(gi, group, device, on_device, grad_scale, clip)

    def _orthogonalize(self, gi: int, group: dict, device: torch.device, params: list[torch.Tensor],
                       grad_scale: torch.Tensor | None, clip: torch.Tensor | None) -> None:
        """:meth:`orthogonalize_for_kernels` for the params of group ``gi`` on ``device``."""
        name = type(self).__name__
        grads = [p.grad for p in params]
        for k, (p, g) in enumerate(zip(params, grads)):
            if g.is_sparse or g.shape != p.shape or g.dtype != p.dtype:
                raise ValueError(f"{name}: param {k} has a gradient of shape {tuple(g.shape)} ({g.dtype}, "
                                 f"sparse={g.is_sparse}); expected a dense {p.dtype} gradient of shape "
                                 f"{tuple(p.shape)}")
        likes = []
        for p in params:
            master = self.master_of(p, group)
            like = p if master is None else master
            self.init_state(p, group, self.state[p], like)
            likes.append(like)
        targets = [self._update_of(p, like) for p, like in zip(params, likes)]
        # the grads as the update launch sees them, in float32 (the targets as scratch)
        torch._foreach_copy_(targets, grads)
        if grad_scale is not None:
            torch._foreach_div_(targets, grad_scale.to(device))
        if clip is not None:
            torch._foreach_mul_(targets, clip.reshape(()))
        elif self.max_grad_value is not None:  # the bound as each grad's dtype stores it
            for dtype in {g.dtype for g in grads}:
                bound = float(torch.tensor(self.max_grad_value, dtype=dtype))
                same = [t for t, g in zip(targets, grads) if g.dtype == dtype]
                torch._foreach_clamp_min_(same, -bound)
                torch._foreach_clamp_max_(same, bound)
        coefficients, steps, eps = tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"]
        key = (BatchedNewtonSchulz.key_of(targets), group["adjust_lr_fn"], coefficients, steps, eps)
        made = self._ns_plans.get((gi, device))
        if made is None or made[0] != key:
            scales = [adjusted_scale(p.shape, group["adjust_lr_fn"]) for p in params]
            plan = BatchedNewtonSchulz(targets, scales, coefficients, steps, eps, clamp_eps=True)
            made = self._ns_plans[(gi, device)] = (key, plan)
        plan = made[1]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        # graph-safe steps: the momentum's entry in the device table prepare_step writes (a replayed
        # step takes the current value)
        momentum = (self.engine.hparams.on(device)[gi * self.HP_WIDTH + _MOM.value] if self.graph_safe
                    else group["momentum"])
        plan.run(bufs, targets, momentum, group["nesterov"], targets, lerp=True)

    def torch_group_step(self, group, params, grads, weights):
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p, g, w in zip(params, grads, weights):
            state = self.state[p]
            self.init_state(p, group, state, w)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - momentum)
            update = g.lerp(buf, momentum) if group["nesterov"] else buf
            update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            w.mul_(1 - lr * wd)
            w.add_(update, alpha=-lr * adjusted_scale(p.shape, group["adjust_lr_fn"]))


__all__ = ["FusedMuon", "adjusted_scale", "newton_schulz"]
