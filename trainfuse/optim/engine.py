"""The fused optimizers' step driver: one multi-tensor launch per device over every param group.

:class:`MultiTensorEngine` steps an optimizer, its *client*, through the members of
:class:`~trainfuse.optim.contract.OptimizerClient`. Per device it launches a *plan*
(``trainfuse._multi_tensor.tables``): a row per param with the raw addresses of its param, grad,
float32 master, EMA tensor, state tensors and step counter. The plan never outlives what it
points at (docs/design/engine.md, "Memory safety"): :class:`~trainfuse.optim.plans.PlanCache`
decides whether a cached plan still holds, for every entry point (``step``, ``scaled_step``,
``check_grads``):

* every address belongs to a storage the plan keeps alive (``plan.keepalive``: params, masters,
  EMA tensors and their sources, states, step counters), or is compared before each launch (the
  grads', with the params' and EMA tensors', :meth:`PlanCache.lookup`);
* before every step, in O(groups), the optimizer's ``state`` and each group's ``params`` are
  compared by identity and mutation counter (:mod:`trainfuse.optim.tracked`), with each group's
  ``plan_key`` (which states a param carries, masters): any change drops the plans
  (:meth:`PlanCache.current_index`);
* every operand has the param's memory layout (grads with other strides go through a conformed
  copy; states, masters and EMA tensors are conformed when the plan is built).

``tests/optim/test_mutations.py`` checks it against torch.optim with random mutations between
steps (interpreter on CPU; ``compute-sanitizer --tool memcheck`` on a GPU).
"""

from __future__ import annotations

import torch

from trainfuse._multi_tensor.tables import Plan, launch_stats, launch_update
from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.launch import CachedLauncher
from trainfuse.optim.contract import OptimizerClient
from trainfuse.optim.direct import DirectStep, step_key
from trainfuse.optim.hparams import HparamTables
from trainfuse.optim.index import ParamIndex
from trainfuse.optim.plans import CachedPlan, PlanCache
from trainfuse.optim.sharded import combine_client_stats_
from trainfuse.optim.torch_path import torch_step


class MultiTensorEngine:
    """Runs one optimizer's step over all its params: Triton plans per device, or the torch path.

    Args:
        client: the optimizer (an :class:`~trainfuse.optim.contract.OptimizerClient`).

    Attributes:
        plans: the cached plans and the check of their validity (:class:`PlanCache`).
        hparams: the hyperparameter table of each device (:class:`HparamTables`).
    """

    def __init__(self, client: OptimizerClient) -> None:
        self.client = client
        # device -> the float32 EMA weight the update reads under the client's graph_safe (kept
        # across invalidate: a captured launch holds its address)
        self._ema_w: dict[torch.device, torch.Tensor] = {}
        self.invalidate()

    def invalidate(self) -> None:
        """Forget every table (param groups, states or layouts changed)."""
        self.plans = PlanCache(self.client)
        self.hparams = HparamTables(self.client)
        self._launcher = CachedLauncher()
        self._stats: dict[torch.device, torch.Tensor] = {}
        self._views: tuple | None = None  # (out, clip, found_inf, scale) views of a stats output
        self._norm_ready = False  # whether _stats holds a norm a step computed

    # ---- the step ------------------------------------------------------------------------------
    def step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """One step: unscaled by ``grad_scale`` and skipped where ``found_inf`` is nonzero (the
        attributes GradScaler sets on the optimizer), or None."""
        plans = self.plans
        index = plans.current_index()
        if index.single:
            device = index.device
            check = plans.take_check(device)
            if check is not None:  # GradScaler's check_grads just validated the plan for this step
                self._launch(device, check[1].plan, grad_scale, found_inf, stats_scale=check[0])
                return
            if use_triton(device):
                found = plans.lookup(device)
                if found is None:  # the params moved to other devices
                    self.step(grad_scale, found_inf)
                    return
                self._launch(device, found[0].plan, grad_scale, found_inf)
                return
            grads = [p.grad for p in index.params]
            self._torch_step(index, device, range(len(grads)), grads, grad_scale, found_inf)
            plans.record_structure()
            return
        entries: dict[torch.device, CachedPlan] = {}
        for device in index.devices:  # every plan found (every build validated) before a launch
            if use_triton(device):
                found = plans.lookup(device)
                if found is None:
                    self.step(grad_scale, found_inf)
                    return
                entries[device] = found[0]
        grads = [p.grad for p in index.params]
        for device, idx in index.devices.items():
            entry = entries.get(device)
            if entry is not None:
                self._launch(device, entry.plan, grad_scale, found_inf)
            else:
                self._torch_step(index, device, idx, grads, grad_scale, found_inf)
        plans.record_structure()

    def check_grads(self, grad_scale: torch.Tensor) -> dict[torch.device, torch.Tensor] | None:
        """GradScaler's inf/NaN check, run by the statistics pass the step needs anyway (it also
        takes the clipping norm): returns ``{device: found_inf}``, or None where this engine cannot
        (params on several devices or on the torch path: the caller then checks as torch does)."""
        found = self._kernel_plan()
        if found is None:
            return None
        device, entry, _ = found
        if grad_scale.device != device:
            grad_scale = grad_scale.to(device, non_blocking=True)
        out = self._run_stats(device, entry.plan, grad_scale)
        self.plans.mark_checked(device, grad_scale, entry)
        return {device: out[2]}

    def scaled_step(self, scale: torch.Tensor, update: tuple) -> bool:
        """GradScaler's ``step`` then ``update`` in two launches: the statistics pass (inf/NaN
        check, norm, and the scale update once every program has read the scale) and the update,
        which divides by the scale the first one read. ``update``: ``(growth_tracker,
        growth_factor, backoff_factor, growth_interval)``. False, with nothing launched, where
        this engine cannot (params on several devices or on the torch path, sharded params, no
        gradient at all): the caller then steps and updates as torch does."""
        client = self.client
        self.plans.current_index()  # the index names a DTensor model's shard group
        if self._shard_group() is not None:  # found_inf must be combined over the group first
            return False
        found = self._kernel_plan()
        if found is None:
            return False
        device, entry, hot = found
        plan = entry.plan
        if scale.device != device or plan.ngrad == 0:
            return False
        hot = hot and not client.graph_safe  # graph-safe launches read the EMA weight's tensor
        hp = self.hparams.on(device)  # validated before anything launches: a bad lr leaves the scale as is
        direct = entry.direct
        if (hot and direct is not None and self._launcher.direct() and direct.key == step_key(
                client, scale, update, hp, plan.kernel_key, self._stats.get(device))):
            direct.launch(0.0 if client.ema_weight is None else client.ema_weight)
            for g, tmp in plan.copy_back:
                g.copy_(tmp)
            self._norm_ready = self._norm_ready or client.max_grad_norm is not None
            return True
        self._launcher.last = None
        out, _, found_inf, read_scale = self._views_of(self._run_stats(device, plan, scale, update))
        stats, self._launcher.last = self._launcher.last, None
        self._launch(device, plan, read_scale, found_inf, hp, stats_scale=read_scale)
        launched = self._launcher.last
        entry.direct = None
        if hot and stats is not None and launched is not None and client.max_grad_value is None:
            key = step_key(client, scale, update, hp, plan.kernel_key, out)
            entry.direct = DirectStep(key, scale, update[0], hp, out, device.index, stats, plan.ngrad,
                                      launched, plan.nchunks)
        return True

    def fused_step(self) -> bool:
        """One step without a GradScaler, on the kernels only: the statistics pass where clipping
        by norm needs one, then the update launch, the same launches :meth:`step` makes there (a
        CUDA graph captured around it replays as the next step once the client is graph-safe).
        False, with nothing launched, where this engine cannot (params on several devices or on
        the torch path, sharded params, no gradient at all): the caller then calls :meth:`step`."""
        found = self._fused_plan()
        if found is None:
            return False
        device, plan = found
        self._launch(device, plan, None, None, self.hparams.on(device))
        return True

    def _fused_plan(self) -> tuple[torch.device, Plan] | None:
        """``(device, plan)`` for :meth:`fused_step`, or None where it cannot run."""
        self.plans.current_index()  # the index names a DTensor model's shard group
        if self._shard_group() is not None:  # the norm is all-reduced over the group
            return None
        found = self._kernel_plan()
        if found is None or found[1].plan.ngrad == 0:
            return None
        return found[0], found[1].plan

    def _kernel_plan(self) -> tuple[torch.device, CachedPlan, bool] | None:
        """``(device, entry, hot)`` for a statistics pass and the step right after it: the params'
        one device, its plan (:meth:`PlanCache.lookup`) and whether it was cached. None where the
        kernels do not run (params on several devices, the torch path) or the params moved to
        other devices."""
        index = self.plans.current_index()
        if not index.single:
            return None
        device = index.device
        if not use_triton(device):
            return None
        found = self.plans.lookup(device)
        return None if found is None else (device, *found)

    def _run_stats(self, device, plan: Plan, grad_scale: torch.Tensor, scale_update: tuple | None = None
                   ) -> torch.Tensor:
        """The statistics launch over ``plan`` (inf/NaN check, and the norm when the client clips
        by norm), combined over the client's shard group: the device's ``out`` it wrote."""
        out = self._stats_out(device)
        clipping = self.client.max_grad_norm is not None
        launch_stats(self._launcher, plan, out, grad_scale=grad_scale,
                     max_norm=self.client.max_grad_norm or 0.0, norm_type=2.0 if clipping else None,
                     scale_update=scale_update)
        combine_client_stats_(self.client, out, clipping, self._shard_group())
        self._norm_ready = self._norm_ready or clipping
        return out

    def _shard_group(self):
        """The process group the params' grads are sharded over: the client's ``shard_group``,
        else the one of its DTensor params (:func:`trainfuse.optim.dtensors.shard_group`)."""
        group = self.client.shard_group
        if group is None and self.plans.index is not None:
            group = self.plans.index.shard_group
        return group

    def forget_check(self) -> None:
        """Drop a :meth:`check_grads` result the step did not consume (the step raised): the next
        step must validate its grads again."""
        self.plans.forget_checks()

    def _views_of(self, out: torch.Tensor) -> tuple:
        """``(out, clip coefficient, found_inf, scale read)``: ``out[1:2]``, ``out[2:3]`` and
        ``out[3:4]``, made once (a view costs ~2 us)."""
        views = self._views
        if views is None or views[0] is not out:
            views = self._views = (out, out[1:2], out[2:3], out[3:4])
        return views

    def _stats_out(self, device) -> torch.Tensor:
        out = self._stats.get(device)
        if out is None:
            out = self._stats[device] = torch.zeros(4, dtype=torch.float32, device=device)
        return out

    def grad_norm(self) -> torch.Tensor | None:
        """Total gradient norm taken by the last clipping step (a device tensor, no sync), or
        None when no step computed one."""
        if not self._norm_ready:
            return None
        for out in self._stats.values():
            return out[0]
        return None

    # ---- launches ----------------------------------------------------------------------------
    def _launch(self, device, plan: Plan, grad_scale, found_inf, hp=None, stats_scale=None,
                stats_done: bool = False) -> None:
        """The update launch over ``plan``, after the statistics pass it needs (clipping by norm)
        unless one already ran: with ``stats_scale`` (GradScaler's check) as ``grad_scale``, or
        over these grads unscaled (``stats_done``)."""
        client = self.client
        if plan.nchunks == 0:
            group = self._shard_group()
            if group is not None and client.max_grad_norm is not None and stats_scale is None:
                out = self._stats_out(device)  # no shard here: the other ranks' all-reduce needs ours
                out.zero_()
                combine_client_stats_(client, out, True, group)
            return
        if hp is None:
            hp = self.hparams.on(device)
        if grad_scale is not None and grad_scale.device != device:
            grad_scale = grad_scale.to(device, non_blocking=True)
        if found_inf is not None and found_inf.device != device:
            found_inf = found_inf.to(device, non_blocking=True)
        clip = clip_value = None
        if client.max_grad_value is not None:  # a clamp in the update itself: no statistics pass
            clip_value = client.clip_value_on(device)
        elif client.max_grad_norm is not None:
            out = self._stats_out(device)
            if not stats_done and (stats_scale is None or stats_scale is not grad_scale):  # none ran yet
                launch_stats(self._launcher, plan, out, grad_scale=grad_scale,
                             max_norm=client.max_grad_norm, norm_type=2.0)
                combine_client_stats_(self.client, out, True, self._shard_group())
            self._norm_ready = True
            clip = self._views_of(out)[1]
        launch_update(self._launcher, client.chunk_fn, plan, hp, wide16=client.wide16,
                      grad_scale=grad_scale, clip=clip, clip_value=clip_value, found_inf=found_inf,
                      ema_w=self._ema_arg(device), width=client.HP_WIDTH)
        if grad_scale is not None or clip is not None or clip_value is not None:
            for g, tmp in plan.copy_back:
                g.copy_(tmp)

    def _torch_step(self, index: ParamIndex, device, idx, grads, grad_scale, found_inf) -> None:
        total = torch_step(self.client, index, device, idx, grads, grad_scale, found_inf, self._shard_group())
        if total is not None:
            self._stats_out(device)[0].copy_(total)
            self._norm_ready = True

    def refresh_hparams(self) -> None:
        """Write the groups' current hyperparameters into each device's table, in place."""
        self.hparams.refresh()

    # ---- graph-safe steps ----------------------------------------------------------------------
    def _ema_arg(self, device) -> float | torch.Tensor:
        """What the update launch takes as EMA weight: the client's ``ema_weight`` (0 without
        one), or under ``graph_safe`` the device tensor :meth:`write_ema_weight` fills."""
        if not self.client.graph_safe:
            w = self.client.ema_weight
            return 0.0 if w is None else w
        t = self._ema_w.get(device)
        if t is None:
            t = self._ema_w[device] = torch.zeros(1, dtype=torch.float32, device=device)
        return t

    def write_ema_weight(self) -> None:
        """Fill every device's EMA-weight tensor with the client's ``ema_weight`` (0 without one):
        one small launch a device, ordered before the next step's launches on the stream."""
        w = self.client.ema_weight
        for device in self.plans.current_index().devices:
            self._ema_arg(device).fill_(0.0 if w is None else w)


__all__ = ["MultiTensorEngine"]
