"""The fused optimizers' step driver: one multi-tensor launch per device over every param group.

Per device the driver keeps a *plan* (``trainfuse._multi_tensor.tables``): a row per param with
the raw addresses of its param, grad, float32 master, EMA tensor, state tensors and step counter.
The plan never outlives what it points at (docs/design/engine.md, "Memory safety"):

* every address belongs to a storage the plan keeps alive (``plan.keepalive``: params, masters,
  EMA tensors and their sources, states, step counters), or is compared before each launch (the
  grads', with the params' and EMA tensors', :meth:`MultiTensorEngine._hot_plan`);
* before every step, in O(groups), the optimizer's ``state`` and each group's ``params`` are
  compared by identity and mutation counter (:mod:`trainfuse.optim.tracked`), with each group's
  ``plan_key`` (which states a param carries, masters): any change drops the plans;
* every operand has the param's memory layout (grads with other strides go through a conformed
  copy; states, masters and EMA tensors are conformed when the plan is built).

``tests/optim/test_mutations.py`` checks it against torch.optim with random mutations between
steps (interpreter on CPU; ``compute-sanitizer --tool memcheck`` on a GPU).
"""

from __future__ import annotations

import operator

import torch

from trainfuse._multi_tensor.tables import Plan, full_grad_key, launch_stats, launch_update, patch_grads
from trainfuse._runtime.backend import use_triton
from trainfuse._runtime.launch import CachedLauncher
from trainfuse.optim.build import build_plan
from trainfuse.optim.direct import DirectStep, step_key
from trainfuse.optim.hparams import hparams_table
from trainfuse.optim.sharded import combine_client_stats_
from trainfuse.optim.torch_path import TorchPath
from trainfuse.optim.tracked import changed, snapshot

_grad = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr


class MultiTensorEngine(TorchPath):
    """Runs one optimizer's step over all its params: Triton plans per device, or the torch path.

    The optimizer (the *client*) supplies, as methods: ``state_keys``, ``init_state``,
    ``prepare_state``, ``step_tensor``, ``plan_key``, ``hparams_row``, ``check_hparams``,
    ``torch_group_step``, ``master_of``, ``ema_target``, ``ema_pairs``, ``ema_tensors``,
    ``track_mutations``, ``check_clipping``, ``clip_value_on``, and as attributes ``chunk_fn``,
    ``wide16``, ``HP_WIDTH``, ``max_grad_norm``, ``max_grad_value`` and ``ema_weight`` (see
    :class:`trainfuse.optim._base.FusedOptimizer`).
    """

    def __init__(self, client: torch.optim.Optimizer):
        self.client = client
        self.invalidate()

    def invalidate(self) -> None:
        """Forget every table (param groups, states or layouts changed)."""
        self._launcher = CachedLauncher()
        self._indexed = False
        self._plans: dict[torch.device, Plan] = {}
        self._hp: dict[torch.device, tuple[list[float], torch.Tensor]] = {}
        self._stats: dict[torch.device, torch.Tensor] = {}
        self._views: tuple | None = None  # (out, clip, found_inf, scale) views of a stats output
        # device -> (grad_scale, plan) of a statistics pass GradScaler ran just before the step
        self._checked: dict[torch.device, tuple[torch.Tensor, Plan]] = {}
        self._ekey_flat = None  # the EMA pair list _ekey_tensors was made from
        self._structure: tuple | None = None  # what _snapshot saw after the last step
        self._norm_ready = False  # whether _stats holds a norm a step computed

    # ---- what the tables depend on besides addresses ---------------------------------------
    def _check_structure(self) -> None:
        """Drop every plan when the state, a param list or a state-shaping hyperparameter
        changed: the next launch then runs on tables built from what is there now."""
        if self._structure is None or changed(self._structure, self.client):
            self._structure = None
            self._plans.clear()
            self._checked.clear()
            self._index()

    # ---- indexing and validation -------------------------------------------------------------
    def _index(self) -> None:
        self.client.track_mutations()
        groups = self.client.param_groups
        self._params = [p for g in groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
        devices: dict[torch.device, list[int]] = {}
        for i, p in enumerate(self._params):
            devices.setdefault(p.device, []).append(i)
        self._devices = devices
        self._single = len(devices) == 1
        self._indexed = True
        self._ekey_flat = None

    # ---- the step ------------------------------------------------------------------------------
    def _hot_plan(self, device) -> Plan | None:
        """The cached plan when params, grads and EMA tensors sit where it expects them: two
        address lists compared (the grads', then the params' and EMA tensors' together), the
        whole check for yolov5n's 219 params and 358 EMA tensors. When only the grads moved
        (``zero_grad(set_to_none=True)``, then a backward that allocated elsewhere: most steps
        of a real run) and kept their layouts, their column is patched here and the plan kept."""
        plan = self._plans.get(device)
        if plan is None or plan.volatile or plan.fixed_key is None:
            return None
        try:
            grads = list(map(_grad, plan.with_grad))
            gkey = list(map(_data_ptr, grads))
        except (TypeError, RuntimeError):  # a grad became None, or sparse
            return None
        if list(map(_data_ptr, plan.fixed)) != plan.fixed_key:
            return None
        for p in plan.without_grad:  # frozen params: usually none, or a few
            if p.grad is not None:
                return None
        if plan.eflat is not self.client.ema_tensors():  # EMA attached, detached or re-paired
            return None
        if gkey != plan.hot_gkey:
            if not patch_grads(plan, grads, gkey):
                return None
            plan.hot_gkey, plan.gkey = gkey, None  # the full key is rebuilt where it is compared
        return plan


    def step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        self._check_structure()
        if not self._step(grad_scale, found_inf) or self._structure is None:
            self._structure = snapshot(self.client)  # a build or the torch path may have changed state

    def _step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> bool:
        """One step; True when it launched on a cached plan, touching no state."""
        if not self._indexed:
            self._index()
        params = self._params
        if self._single:
            (device,) = self._devices
            checked = self._checked.get(device)
            if checked is not None and checked[1] is self._plans.get(device):
                # GradScaler's check_grads just validated the plan (and the backend) for this step
                self._launch(device, checked[1], grad_scale, found_inf)
                return True
            if use_triton(device):
                plan = self._hot_plan(device)
                if plan is not None:  # the hot path: one pass over the params, then launch
                    self._launch(device, plan, grad_scale, found_inf)
                    return True
                grads = [p.grad for p in params]
                self._triton_step(device, None, grads, grad_scale, found_inf)
            else:
                grads = [p.grad for p in params]
                self._torch_step(device, range(len(params)), grads, grad_scale, found_inf)
            return False
        grads = [p.grad for p in params]
        plans_ok = all(self._plan_valid(d, idx, grads) for d, idx in self._devices.items()
                       if use_triton(d))
        if not plans_ok:
            self._index()
            self.validate(grads, kernels=True)
        for device, idx in self._devices.items():
            if use_triton(device):
                self._triton_step(device, idx, grads, grad_scale, found_inf)
            else:
                self._torch_step(device, idx, grads, grad_scale, found_inf)
        return False

    def check_grads(self, grad_scale: torch.Tensor) -> dict[torch.device, torch.Tensor] | None:
        """GradScaler's inf/NaN check, run by the statistics pass the step needs anyway (it also
        takes the clipping norm): returns ``{device: found_inf}``, or None where this engine cannot
        (params on several devices or on the torch path: the caller then checks as torch does)."""
        found = self._kernel_plan()
        if found is None:
            return None
        device, plan, _ = found
        if grad_scale.device != device:
            grad_scale = grad_scale.to(device, non_blocking=True)
        out = self._run_stats(device, plan, grad_scale)
        self._checked[device] = (grad_scale, plan)
        self._structure = snapshot(self.client)
        return {device: out[2]}

    def scaled_step(self, scale: torch.Tensor, update: tuple) -> bool:
        """GradScaler's ``step`` then ``update`` in two launches: the statistics pass (inf/NaN
        check, norm, and the scale update once every program has read the scale) and the update,
        which divides by the scale the first one read. ``update``: ``(growth_tracker,
        growth_factor, backoff_factor, growth_interval)``. False, with nothing launched, where
        this engine cannot (params on several devices or on the torch path, sharded params, no
        gradient at all): the caller then steps and updates as torch does."""
        if self.client.shard_group is not None:  # found_inf must be combined over the group first
            return False
        found = self._kernel_plan()
        if found is None:
            return False
        device, plan, hot = found
        if scale.device != device or plan.ngrad == 0:
            return False
        hp = self._hparams(device)  # validated before anything launches: a bad lr leaves the scale as is
        client = self.client
        direct = plan.direct
        if (hot and direct is not None and self._launcher.direct()
                and direct.key == step_key(client, scale, update, hp, plan.tkey, self._stats.get(device))):
            direct.launch(0.0 if client.ema_weight is None else client.ema_weight)
            for g, tmp in plan.copy_back:
                g.copy_(tmp)
            self._norm_ready = self._norm_ready or client.max_grad_norm is not None
            return True
        self._launcher.last = None
        out, _, found_inf, read_scale = self._views_of(self._run_stats(device, plan, scale, update))
        stats, self._launcher.last = self._launcher.last, None
        self._checked[device] = (read_scale, plan)
        self._launch(device, plan, read_scale, found_inf, hp)
        launched = self._launcher.last
        plan.direct = None
        if hot and stats is not None and launched is not None and client.max_grad_value is None:
            key = step_key(client, scale, update, hp, plan.tkey, out)
            plan.direct = DirectStep(key, scale, update[0], hp, out, device.index, stats, plan.ngrad,
                                     launched, plan.nchunks)
        if not hot or self._structure is None:  # a build may have changed state
            self._structure = snapshot(self.client)
        return True

    def _kernel_plan(self) -> tuple[torch.device, Plan, bool] | None:
        """``(device, plan, hot)`` for a statistics pass and the step right after it: the params'
        one device, its plan (cached and checked on the hot path, else patched or built), and
        whether the hot path gave it. None where the kernels do not run (params on several
        devices, the torch path) or the params moved to other devices."""
        self._check_structure()
        if not self._single:
            return None
        (device,) = self._devices
        if not use_triton(device):
            return None
        plan = self._hot_plan(device)
        if plan is not None:
            return device, plan, True
        plan = self._plan_for(device, None, [p.grad for p in self._params])
        return None if plan is None else (device, plan, False)

    def _run_stats(self, device, plan: Plan, grad_scale: torch.Tensor, scale_update: tuple | None = None
               ) -> torch.Tensor:
        """The statistics launch over ``plan`` (inf/NaN check, and the norm when the client clips
        by norm), combined over the client's shard group: the device's ``out`` it wrote."""
        out = self._stats_out(device)
        clipping = self.client.max_grad_norm is not None
        launch_stats(self._launcher, plan, out, grad_scale=grad_scale,
                     max_norm=self.client.max_grad_norm or 0.0, norm_type=2.0 if clipping else None,
                     scale_update=scale_update)
        combine_client_stats_(self.client, out, clipping)
        self._norm_ready = self._norm_ready or clipping
        return out

    def forget_check(self) -> None:
        """Drop a :meth:`check_grads` result the step did not consume (the step raised): the next
        step must validate its grads again."""
        self._checked.clear()

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

    # ---- triton path ---------------------------------------------------------------------------
    def _keys(self, idx, grads):
        params = self._params
        if idx is not None:
            params = [params[i] for i in idx]
            grads = [grads[i] for i in idx]
        pkey = [p.data_ptr() for p in params]
        try:
            gkey = [g.data_ptr() for g in grads]
        except AttributeError:  # some grads are None
            gkey = [0 if g is None else g.data_ptr() for g in grads]
        return pkey, gkey

    def _ema_tensors(self) -> list[torch.Tensor] | None:
        """The attached EMA's tensors and their sources, less the sources that are this
        optimizer's params: every check of their addresses checks the params' too (yolov5n: 503
        addresses a step instead of 716)."""
        flat = self.client.ema_tensors()
        if flat is None:
            return None
        if self._ekey_flat is not flat:
            params = {id(p) for p in self._params}
            self._ekey_tensors = [t for t in flat if id(t) not in params]
            self._ekey_flat = flat
        return self._ekey_tensors

    def _ema_key(self) -> list[int] | None:
        tensors = self._ema_tensors()
        return None if tensors is None else list(map(_data_ptr, tensors))

    def _plan_valid(self, device, idx, grads) -> bool:
        plan = self._plans.get(device)
        if plan is None or plan.volatile:
            return False
        try:
            pkey, gkey = self._keys(idx, grads)
        except RuntimeError:  # e.g. a sparse grad has no data pointer
            return False
        return pkey == plan.pkey and gkey == full_grad_key(plan) and plan.ekey == self._ema_key()

    def _plan_for(self, device, idx, grads) -> Plan | None:
        """The plan for this step: cached, grad column patched, or rebuilt. None when the params
        moved to other devices (the caller starts over)."""
        plan = self._plans.get(device)
        try:
            pkey, gkey = self._keys(idx, grads)
        except RuntimeError:
            pkey = gkey = None
        ekey = self._ema_key()
        if plan is not None:
            full_grad_key(plan)
        if plan is None or plan.volatile or pkey != plan.pkey or gkey != plan.gkey or ekey != plan.ekey:
            if ekey != getattr(plan, "ekey", None) or not self._refresh_grads(plan, pkey, gkey, idx, grads):
                if idx is None:  # single-device path: re-check what the key cannot see
                    self._index()
                    self.validate(grads, kernels=True)
                    if not self._single or device not in self._devices:  # params moved devices
                        return None
                plan = build_plan(self.client, self._params, self._group_of, device, idx, grads)
                plan.pkey, plan.gkey = self._keys(idx, grads)
                plan.ekey = self._ema_key()  # after the build, which may re-lay-out EMA tensors
                self._plans[device] = plan
        if idx is None:  # what the single-device hot path compares
            plan.with_grad = [p for p, g in zip(self._params, grads) if g is not None]
            plan.without_grad = [p for p, g in zip(self._params, grads) if g is None]
            plan.hot_gkey = [g.data_ptr() for g in grads if g is not None]
            plan.eflat = self.client.ema_tensors()
            plan.fixed = self._params + (self._ema_tensors() or [])
            plan.fixed_key = list(map(_data_ptr, plan.fixed))
        return plan

    def _triton_step(self, device, idx, grads, grad_scale, found_inf) -> None:
        plan = self._plan_for(device, idx, grads)
        if plan is None:
            self.step(grad_scale, found_inf)
            return
        self._launch(device, plan, grad_scale, found_inf)

    def _refresh_grads(self, plan, pkey, gkey, idx, grads) -> bool:
        """Only grad addresses changed (``zero_grad(set_to_none=True)`` and a backward that
        allocated elsewhere): patch the grad column instead of rebuilding. False when more changed.
        """
        if plan is None or plan.volatile or pkey is None or pkey != plan.pkey:
            return False
        if [k == 0 for k in gkey] != [k == 0 for k in plan.gkey]:  # a grad appeared or vanished
            return False
        if idx is not None:
            grads = [grads[i] for i in idx]
        live = [grads[i] for i in plan.slots]
        if not patch_grads(plan, live, [g.data_ptr() for g in live]):
            return False
        plan.gkey = gkey
        return True

    def _launch(self, device, plan, grad_scale, found_inf, hp=None) -> None:
        client = self.client
        checked = self._checked.pop(device, None)
        if plan.nchunks == 0:
            return
        if hp is None:
            hp = self._hparams(device)
        if grad_scale is not None and grad_scale.device != device:
            grad_scale = grad_scale.to(device, non_blocking=True)
        if found_inf is not None and found_inf.device != device:
            found_inf = found_inf.to(device, non_blocking=True)
        clip = clip_value = None
        if client.max_grad_value is not None:  # a clamp in the update itself: no statistics pass
            clip_value = client.clip_value_on(device)
        elif client.max_grad_norm is not None:
            out = self._stats_out(device)
            if checked is None or checked[0] is not grad_scale:  # GradScaler did not run it for us
                launch_stats(self._launcher, plan, out, grad_scale=grad_scale,
                             max_norm=client.max_grad_norm, norm_type=2.0)
                combine_client_stats_(self.client, out, True)
            self._norm_ready = True
            clip = self._views_of(out)[1]
        ema_w = client.ema_weight
        launch_update(self._launcher, client.chunk_fn, plan, hp, wide16=client.wide16,
                      grad_scale=grad_scale, clip=clip, clip_value=clip_value, found_inf=found_inf,
                      ema_w=0.0 if ema_w is None else ema_w, width=client.HP_WIDTH)
        if grad_scale is not None or clip is not None or clip_value is not None:
            for g, tmp in plan.copy_back:
                g.copy_(tmp)

    def _hparams(self, device) -> torch.Tensor:
        return hparams_table(self.client, self._hp, device)

    def refresh_hparams(self) -> None:
        """Write the groups' current hyperparameters into each device's table, in place."""
        for device in list(self._hp):
            self._hparams(device)


__all__ = ["MultiTensorEngine"]
