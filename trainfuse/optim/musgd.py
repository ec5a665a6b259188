r"""FusedMuSGD: ultralytics' ``MuSGD`` (Muon + SGD momentum) on the multi-tensor engine.

Groups with ``use_muon: False`` take SGD with momentum (no dampening). For a param
:math:`\theta` of a ``use_muon`` group, with gradient :math:`g`, learning rate :math:`\gamma`,
momentum :math:`\mu` and the optimizer's factors ``muon`` :math:`\alpha` and ``sgd`` :math:`\beta`:

.. math::
    m &\leftarrow \mu m + (1-\mu) g \\
    u &\leftarrow \mu m + (1-\mu) g \ \text{(Nesterov)} \quad\text{or}\quad u \leftarrow m \\
    \theta &\leftarrow \theta - \gamma\alpha\, \sqrt{\max(1, d_{-2}/d_{-1})}\ \mathrm{NS}_5(u) \\
    g &\leftarrow g + \lambda\theta \\
    b &\leftarrow \mu b + g \\
    \theta &\leftarrow \theta - \gamma\beta\, (g + \mu b \ \text{(Nesterov)} \ \text{or}\ b)

:math:`\mathrm{NS}_5` is five quintic Newton-Schulz iterations in bfloat16 on :math:`u` flattened to
two dims in its own memory order (channels_last too), :math:`d_{-2}, d_{-1}` the param's last two
dims; plain SGD groups take the last three lines with :math:`\beta = 1`. The state_dict is
MuSGD's: ``momentum_buffer`` (:math:`m`, or :math:`b` in SGD groups) and, in ``use_muon`` groups,
``momentum_buffer_SGD`` (:math:`b`).

On the kernels the Newton-Schulz part runs first (:class:`~trainfuse.optim.newton_schulz.
BatchedNewtonSchulz`: the Muon momentum and its blend, then every matrix padded into a few bfloat16
batches by size, a Triton gather and scatter around cuBLAS's batched matmuls), and writes
:math:`\mathrm{NS}_5(u)` times its scale into a private per-param tensor; the one multi-tensor
launch then does the rest of every param's update: the Muon momentum, applying the orthogonalized
update, weight decay, the SGD momentum and step. Under GradScaler (``step_and_update``) the
statistics pass runs first and the Newton-Schulz part reads the grads divided by the scale it read;
graph-safe steps read the momentum from the device table, so the whole step replays from a CUDA
graph. The torch path orthogonalizes with MuSGD's own batching
(:func:`~trainfuse.optim.newton_schulz.orthogonalized`), bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from trainfuse._multi_tensor import kernels as mt
from trainfuse._multi_tensor.tables import same_layout
from trainfuse._runtime.backend import use_triton
from trainfuse.optim._base import FusedOptimizer
from trainfuse.optim.engine import MultiTensorEngine
from trainfuse.optim.newton_schulz import BatchedNewtonSchulz, orthogonalized

# hyperparameter row: momentum, weight_decay, nesterov, use_muon, -lr*muon, -lr*sgd (-lr without Muon)
_MOM, _WD, _NEST, _MUON, _MUON_STEP, _SGD_STEP = (tl.constexpr(k) for k in range(6))

@triton.jit
def _musgd_chunk(row, r, hp, arrivals, start, n, scale, clip, ema_w, PARAM_DT: tl.constexpr,
                 STATE_DT: tl.constexpr, EMA_DT: tl.constexpr, MASTER: tl.constexpr, EMA: tl.constexpr,
                 BLOCK: tl.constexpr, NB: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, WIDTH: tl.constexpr):
    # states: OP_STATE the SGD buffer b (every row); OP_STATE + 1 the Muon momentum m and
    # OP_STATE + 2 the orthogonalized update (rows of use_muon groups only)
    hp_row = mt.hparams_row(hp, row, WIDTH)
    muon = tl.load(hp_row + _MUON) != 0.0
    offs = tl.arange(0, BLOCK)
    w_ptr, p_ptr = mt.weight_ptrs(row, start, PARAM_DT, MASTER, ALIGNED)
    g_ptr = mt.operand(row, mt.OP_GRAD, start, PARAM_DT, ALIGNED)
    e_ptr = mt.operand(row, mt.OP_EMA, start, EMA_DT, ALIGNED)
    b_ptr = mt.operand(row, mt.OP_STATE, start, STATE_DT, ALIGNED)
    m_ptr = mt.operand(row, mt.OP_STATE + 1, start, STATE_DT, ALIGNED)
    u_ptr = mt.operand(row, mt.OP_STATE + 2, start, STATE_DT, ALIGNED)
    p = mt.load(w_ptr, offs, n, MASKED)
    g = mt.load(g_ptr, offs, n, MASKED)
    b = mt.load(b_ptr, offs, n, MASKED)
    m = mt.load_if(m_ptr, offs, n, muon, MASKED)
    u = mt.load_if(u_ptr, offs, n, muon, MASKED)
    e = mt.load_opt(e_ptr, offs, n, EMA, MASKED)
    momentum = tl.load(hp_row + _MOM)
    mu = momentum.to(tl.float32)
    one_minus_mu = (1.0 - momentum).to(tl.float32)  # MuSGD's alpha=1 - beta, rounded once
    wd = tl.load(hp_row + _WD).to(tl.float32)
    nesterov = tl.load(hp_row + _NEST) != 0.0
    muon_step = tl.load(hp_row + _MUON_STEP).to(tl.float32)
    sgd_step = tl.load(hp_row + _SGD_STEP).to(tl.float32)

    for k in tl.static_range(NB):
        o = offs + k * BLOCK
        if k + 1 < NB:  # prefetch the next block before this one's math and stores
            o_next = o + BLOCK
            p_next = mt.load(w_ptr, o_next, n, MASKED)
            g_next = mt.load(g_ptr, o_next, n, MASKED)
            b_next = mt.load(b_ptr, o_next, n, MASKED)
            m_next = mt.load_if(m_ptr, o_next, n, muon, MASKED)
            u_next = mt.load_if(u_ptr, o_next, n, muon, MASKED)
            e_next = mt.load_opt(e_ptr, o_next, n, EMA, MASKED)
        g = mt.grad_in(g_ptr, o, n, g, scale, clip, False, HAS_SCALE, HAS_CLIP, MASKED)
        # the Muon momentum the host orthogonalized from, recomputed here so a step GradScaler
        # skips leaves it as it was
        m = m * mu + one_minus_mu * g
        mt.store_if(m_ptr, o, n, m, muon, MASKED)
        p = tl.where(muon, p + muon_step * u, p)
        g = tl.where(wd != 0.0, g + wd * p, g)  # from the weight the Muon step moved
        b = b * mu + g
        mt.store(b_ptr, o, n, b, MASKED)
        d = tl.where(nesterov, g + mu * b, b)
        p = p + sgd_step * d
        mt.store_weight(w_ptr, p_ptr, o, n, p, MASTER, MASKED)
        mt.ema_fold(e_ptr, o, n, e, p, ema_w, STATE_DT, EMA, MASKED)
        if k + 1 < NB:
            p, g, b, m, u, e = p_next, g_next, b_next, m_next, u_next, e_next


def _muon_momentum(bufs: list[torch.Tensor], grads: list[torch.Tensor], momentum: float, nesterov: bool,
                   in_place: bool) -> list[torch.Tensor]:
    """The matrices Newton-Schulz orthogonalizes: ``m = mu m + (1 - mu) g`` (into ``bufs`` when
    ``in_place``, else new tensors) and its Nesterov blend, with MuSGD's ops in MuSGD's order."""
    if in_place:
        torch._foreach_mul_(bufs, momentum)
        nxt = bufs
    else:
        nxt = list(torch._foreach_mul(bufs, momentum))
    torch._foreach_add_(nxt, grads, alpha=1 - momentum)
    if not nesterov:
        return list(nxt)
    blended = list(torch._foreach_mul(nxt, momentum))
    torch._foreach_add_(blended, grads, alpha=1 - momentum)
    return blended


class MuonEngine(MultiTensorEngine):
    """The step driver with the Newton-Schulz part before each update launch (its client has
    ``orthogonalize_for_kernels`` and ``muon_grads``: FusedMuSGD, FusedMuon). Clipping by norm
    runs the statistics pass first: its clip coefficient scales the grads Newton-Schulz reads,
    and the update launch reuses the pass (marked as checked) instead of running another."""

    def step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        if grad_scale is None and found_inf is None and self.fused_step():
            return  # one statistics pass, which the update launch reuses
        self.client.orthogonalize_for_kernels(grad_scale, self._clip_coefficient(grad_scale))
        super().step(grad_scale, found_inf)

    def _clip_coefficient(self, grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The device tensor of ``max_grad_norm``'s clip coefficient for this step, or None
        (no clipping by norm, no Muon group with a grad, or the params not on one kernel device)."""
        client = self.client
        if client.max_grad_norm is None or not client.muon_grads():
            return None
        found = self._kernel_plan()
        if found is None:
            return None
        device, entry, _ = found
        check = self.plans.peek_check(device)
        if check is None or check[0] is not grad_scale or grad_scale is None:
            # a statistics pass over this step's grads, which the update launch then takes
            scale = grad_scale
            if scale is not None and scale.device != device:
                scale = scale.to(device, non_blocking=True)
            self._run_stats(device, entry.plan, scale)
            if grad_scale is not None:
                self.plans.mark_checked(device, grad_scale, entry)
        return self._views_of(self._stats_out(device))[1]

    def fused_step(self) -> bool:
        """:meth:`MultiTensorEngine.fused_step` with the Newton-Schulz part before the update
        launch, as :meth:`step` runs it."""
        found = self._fused_plan()
        if found is None:
            return False
        device, plan = found
        clip = self._clip_coefficient(None)  # a statistics pass over the grads where clipping by norm
        self.client.orthogonalize_for_kernels(None, clip)
        self._launch(device, plan, None, None, self.hparams.on(device), stats_done=clip is not None)
        return True

    def scaled_step(self, scale: torch.Tensor, update: tuple) -> bool:
        """GradScaler's ``step`` and ``update`` with the Newton-Schulz part between the two
        launches: the statistics pass (inf/NaN check, norm, the scale updated once read), then the
        grads divided by the scale that pass read and scaled by its clip coefficient, orthogonalized,
        then the update launch, skipped on inf/NaN. False, nothing launched, where the engine
        cannot (see :meth:`MultiTensorEngine.scaled_step`)."""
        client = self.client
        if not client.muon_grads():
            return super().scaled_step(scale, update)
        self.plans.current_index()
        if self._shard_group() is not None:
            return False
        found = self._kernel_plan()
        if found is None:
            return False
        device, entry, _ = found
        plan = entry.plan
        if scale.device != device or plan.ngrad == 0:
            return False
        hp = self.hparams.on(device)  # validated before anything launches
        _, clip, found_inf, read_scale = self._views_of(self._run_stats(device, plan, scale, update))
        client.orthogonalize_for_kernels(read_scale.reshape(()),
                                         clip if client.max_grad_norm is not None else None)
        self._launch(device, plan, read_scale, found_inf, hp, stats_scale=read_scale)
        entry.direct = None  # the cached two-launch step has no Newton-Schulz part
        return True


class FusedMuSGD(FusedOptimizer):
    """Drop-in ``ultralytics.optim.MuSGD``: same arguments, defaults, param groups and state_dict.

    Args:
        params: iterable of params or param-group dicts (a group's ``use_muon`` picks its update).
        lr: learning rate.
        momentum: momentum factor (of the Muon momentum and the SGD buffer).
        weight_decay: L2 penalty of the SGD part.
        nesterov: Nesterov momentum.
        use_muon: the default of the groups' ``use_muon``: Muon + SGD (params of 2+ dims) or SGD.
        muon: the Muon part's factor on ``lr``.
        sgd: the SGD part's factor on ``lr`` in ``use_muon`` groups.
        master_weights, max_grad_norm, max_grad_value: as in :class:`trainfuse.optim.FusedAdam`.
            Clipping applies to the gradients before both parts (the Muon momentum included), as
            ``clip_grad_norm_`` / ``clip_grad_value_`` before ``MuSGD.step`` would.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> weights = [p for p in model.parameters() if p.ndim >= 2]
        >>> biases = [p for p in model.parameters() if p.ndim < 2]
        >>> opt = FusedMuSGD([{"params": weights, "use_muon": True}, {"params": biases}],
        ...                  lr=0.01, momentum=0.9, nesterov=True)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
    """

    chunk_fn = _musgd_chunk
    # graph-safe steps read the Newton-Schulz part's momentum from the device table, and the
    # engine's scaled_step runs that part between its statistics pass and the update: the whole
    # step replays from a CUDA graph (its batches fixed by which params had a grad at capture,
    # which the graphs' checks hold)
    capturable = True
    wide16 = True  # 16-bit rows in blocks twice as long: 16-byte accesses per thread

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        use_muon: bool = False,
        muon: float = 0.5,
        sgd: float = 0.5,
        *,
        master_weights: bool = False,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
    ):
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "use_muon": use_muon,
        }
        if master_weights:  # a group key only when used: default state_dicts stay MuSGD's layout
            defaults["master_weights"] = True
        self.muon = muon
        self.sgd = sgd
        self._private()
        super().__init__(params, defaults, max_grad_norm, max_grad_value)
        self.engine = MuonEngine(self)

    def _private(self) -> None:
        # param -> its orthogonalized update, which the update launch reads (outside the state_dict)
        self._updates: dict[torch.Tensor, torch.Tensor] = {}
        # device -> the step counter every row points at: the update keeps no count
        self._no_step: dict[torch.device, torch.Tensor] = {}
        # (group index, device) -> the Newton-Schulz plan of its params with a grad on the kernels
        self._ns_plans: dict[tuple[int, torch.device], BatchedNewtonSchulz] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["muon"], state["sgd"] = self.muon, self.sgd
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("muon", 0.5)
        self.__dict__.setdefault("sgd", 0.5)
        self._private()
        self.engine = MuonEngine(self)

    def validate_group(self, group):
        name = type(self).__name__
        for key in ("lr", "momentum", "weight_decay"):
            value = group[key]
            if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)) or not value >= 0.0:
                raise ValueError(f"{name}: {key} must be a number >= 0, got {value!r}")
        for key in ("muon", "sgd"):
            value = getattr(self, key)
            if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}: {key} must be a number, got {value!r}")
        if group["use_muon"]:
            for k, p in enumerate(group["params"]):
                if p.ndim < 2:
                    raise ValueError(
                        f"{name}: param {k} of a use_muon group has shape {tuple(p.shape)}; Muon "
                        "orthogonalizes matrices, so use_muon groups take params of 2 or more dims "
                        "(put biases and norms in a group with use_muon=False)")

    def state_keys(self, group):
        # kernel operand order: the SGD buffer first in every row
        return ("momentum_buffer_SGD", "momentum_buffer") if group["use_muon"] else ("momentum_buffer",)

    def init_state(self, p, group, state, like):
        for key in ("momentum_buffer", "momentum_buffer_SGD") if group["use_muon"] else ("momentum_buffer",):
            if state.get(key) is None:
                state[key] = torch.zeros_like(like, memory_format=torch.preserve_format)

    def step_tensor(self, p, state, kernels):
        counter = self._no_step.get(p.device)
        if counter is None:
            counter = self._no_step[p.device] = self._new_step(p, True)
        return counter

    def prepare_state(self, p, group, kernels):
        states, step, master = super().prepare_state(p, group, kernels)
        if group["use_muon"]:
            states = [*states, self._update_of(p, p if master is None else master)]
        return states, step, master

    def _update_of(self, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``p``'s orthogonalized-update tensor, laid out like ``like`` (made when missing or
        unlike it; a replaced one drops the plans, which point at the old one)."""
        u = self._updates.get(p)
        if u is not None and u.dtype == like.dtype and u.device == like.device and same_layout(u, like):
            return u
        if u is not None:
            self.engine.invalidate()
        u = self._updates[p] = torch.zeros_like(like, memory_format=torch.preserve_format)
        return u

    def hparams_row(self, group):
        lr = group["lr"]
        muon = group["use_muon"]
        return [group["momentum"], group["weight_decay"], float(group["nesterov"]), float(muon),
                -(lr * self.muon) if muon else 0.0, -(lr * self.sgd) if muon else -lr]

    def muon_grads(self) -> bool:
        """Whether a ``use_muon`` param has a grad on the kernels (the step has a Muon part)."""
        return any(p.grad is not None and use_triton(p.device)
                   for group in self.param_groups if group["use_muon"] for p in group["params"])

    def orthogonalize_for_kernels(self, grad_scale: torch.Tensor | None, clip: torch.Tensor | None = None
                                  ) -> None:
        """Write the orthogonalized update of every ``use_muon`` param with a grad on the kernels
        into its private tensor, which the update launch reads. The Muon momentum is read, not
        written (the launch writes it, unless GradScaler skips the step).

        Args:
            grad_scale: GradScaler's scale the grads carry, or None.
            clip: the clip coefficient of ``max_grad_norm`` (a one-element device tensor the
                statistics pass wrote), or None.
        """
        name = type(self).__name__
        for gi, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            params = [p for p in group["params"] if p.grad is not None and use_triton(p.device)]
            if not params:
                continue
            if self.max_grad_norm is not None and clip is None:
                raise ValueError(f"{name}: max_grad_norm with use_muon groups needs every param on "
                                 "one device; clip the grads before the step instead")
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
                raise ValueError(f"{name}: param {k} of a use_muon group has a gradient of "
                                 f"shape {tuple(g.shape)} ({g.dtype}, sparse={g.is_sparse}); "
                                 f"expected a dense {p.dtype} gradient of shape {tuple(p.shape)}")
        likes = []
        for p in params:
            master = self.master_of(p, group)
            like = p if master is None else master
            state = self.state[p]
            if state.get("momentum_buffer") is None or state.get("momentum_buffer_SGD") is None:
                self.init_state(p, group, state, like)
            likes.append(like)
        targets = [self._update_of(p, like) for p, like in zip(params, likes)]
        # the grads as the update launch sees them, in float32 (the targets as scratch):
        # divided by the scale, then clipped
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
        plan = self._ns_plans.get((gi, device))
        if plan is None or plan.key != BatchedNewtonSchulz.key_of(targets):
            plan = self._ns_plans[(gi, device)] = BatchedNewtonSchulz(targets)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        plan.run(bufs, targets, self._momentum_on(gi, group, device), group["nesterov"], targets)

    def _momentum_on(self, gi: int, group: dict, device: torch.device) -> float | torch.Tensor:
        """Group ``gi``'s momentum for the Newton-Schulz part: the number, or in graph-safe steps
        its entry in the device table the update launch reads (``prepare_step`` writes it there:
        a replayed step takes the current value, as during ultralytics' momentum warmup)."""
        if not self.graph_safe:
            return group["momentum"]
        return self.engine.hparams.on(device)[gi * self.HP_WIDTH + _MOM.value]

    def torch_group_step(self, group, params, grads, weights):
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        states = [self.state[p] for p in params]
        for p, w, state in zip(params, weights, states):
            if len(state) == 0:
                self.init_state(p, group, state, w)
        if group["use_muon"]:
            updates = orthogonalized(_muon_momentum([s["momentum_buffer"] for s in states], grads, momentum,
                                                    nesterov, in_place=True))
            torch._foreach_add_(weights, updates, alpha=-(lr * self.muon))
            buffers = [s["momentum_buffer_SGD"] for s in states]
            lr *= self.sgd
        else:
            buffers = [s["momentum_buffer"] for s in states]
        if group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, weights, alpha=group["weight_decay"])
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        updates = torch._foreach_add(grads, buffers, alpha=momentum) if nesterov else buffers
        torch._foreach_add_(weights, updates, alpha=-lr)


__all__ = ["FusedMuSGD", "MuonEngine"]
