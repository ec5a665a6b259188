"""The plans of one optimizer, per device, and the one place that decides whether a cached plan
still holds: :class:`PlanCache`.

A plan launches from raw addresses, so it must never outlive what they point at
(docs/design/engine.md, "Memory safety"). The cache keeps that promise with two checks, and
every entry point of the step driver (``step``, ``scaled_step``, ``check_grads``) goes through
both:

* :meth:`PlanCache.current_index`, before anything else, in O(groups): the optimizer's ``state``
  and each group's ``params`` compared by identity and mutation counter
  (:mod:`trainfuse.optim.tracked`), and each group's ``plan_key``; any change drops every plan;
* :meth:`PlanCache.lookup`, per device: the addresses a plan holds (:class:`CachedPlan`: its
  params' and EMA tensors', its grads') compared with where the tensors are now; a plan whose
  grads alone moved has its grad column patched, any other difference builds a new plan.

Every other address a row holds belongs to a storage the plan keeps alive (``plan.keepalive``:
masters, states, step counters, and the params and EMA tensors too).

A CUDA graph captured around a step holds the plans it launched: :meth:`PlanCache.capture_view`
names what a client compares to know they still hold (:class:`CaptureView`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from trainfuse._multi_tensor.tables import Plan, patch_grads
from trainfuse.optim.build import build_plan
from trainfuse.optim.contract import OptimizerClient
from trainfuse.optim.dtensors import is_dtensor, local, locals_of
from trainfuse.optim.index import ParamIndex
from trainfuse.optim.tracked import changed, snapshot

_grad = operator.attrgetter("grad")
_generations = itertools.count(1)  # every plan set any cache holds gets a number of its own
_data_ptr = torch.Tensor.data_ptr


class CaptureView(NamedTuple):
    """What a CUDA graph captured around a step holds of the plans, as they are now.

    Attributes:
        generation: the plans' generation: it changes whenever a plan is built or the plans are
            dropped (a new group, cleared state, a param's storage moved), and never repeats.
        device: the params' one device, or None (params on several devices, or no index yet).
        params: every param in table order (the index's own list: read it, do not change it;
            empty before the first step).
    """

    generation: int
    device: torch.device | None
    params: Sequence[torch.Tensor]


class CachedPlan:
    """One device's plan and the addresses it was built for, named by what they cover.

    Attributes:
        plan: the device tables.
        volatile: the plan reads conformed copies of some grads (``plan.volatile``): it holds
            for one step only.
        grad_params: the params with a row (a gradient when it was built), in row order.
        grad_addresses: their grads' addresses, as the plan's grad column holds them.
        gradless_params: the device's params without a row (no gradient when it was built).
        param_and_ema_tensors: the device's params, then the attached EMA's tensors and model
            tensors that are not params of this optimizer (checking a param's address once
            covers it as an EMA source too).
        param_and_ema_addresses: their addresses when the plan was built.
        ema_source: the client's ``ema_tensors()`` list the EMA part was taken from (it is the
            same object until the EMA's pairs change).
        direct: the engine's replay of this plan's scaled step
            (:class:`trainfuse.optim.direct.DirectStep`), or None; it dies with the plan.
        dtensors: some of these tensors are DTensors: the addresses are their local shards'
            (taken anew at each check, since a DTensor may be given another local tensor).
    """

    __slots__ = ("plan", "volatile", "grad_params", "grad_addresses", "gradless_params",
                 "param_and_ema_tensors", "param_and_ema_addresses", "ema_source", "direct", "dtensors")

    def __init__(self, plan: Plan, params: list[torch.Tensor], grads: list[torch.Tensor | None],
                 ema_tensors: list[torch.Tensor], ema_source: list[torch.Tensor] | None,
                 dtensors: bool = False) -> None:
        self.plan = plan
        self.volatile = plan.volatile
        self.dtensors = dtensors
        self.grad_params = [p for p, g in zip(params, grads) if g is not None]
        self.grad_addresses = [local(g).data_ptr() for g in grads if g is not None]
        self.gradless_params = [p for p, g in zip(params, grads) if g is None]
        self.param_and_ema_tensors = params + ema_tensors
        self.param_and_ema_addresses = self.addresses(self.param_and_ema_tensors)
        self.ema_source = ema_source
        self.direct = None

    def addresses(self, tensors: list[torch.Tensor]) -> list[int]:
        """Where ``tensors`` (their local shards, for DTensors) are now."""
        if self.dtensors:
            tensors = locals_of(tensors)
        return list(map(_data_ptr, tensors))


class PlanCache:
    """The plans of ``client`` (the optimizer), one per device its params sit on, with the
    :class:`ParamIndex` they were built over and the GradScaler check a step may reuse."""

    def __init__(self, client: OptimizerClient) -> None:
        self.client = client
        # changes whenever a plan is built or the plans are dropped (never repeats, also across
        # caches): a CUDA graph captured around a step holds while it is unchanged
        self.generation = next(_generations)
        self.index: ParamIndex | None = None
        self._entries: dict[torch.device, CachedPlan] = {}
        self._structure: tuple | None = None  # what tracked.snapshot saw when the plans were valid
        # device -> (grad_scale, entry) of a statistics pass GradScaler ran just before the step
        self._checks: dict[torch.device, tuple[torch.Tensor, CachedPlan]] = {}
        self._view: CaptureView | None = None  # capture_view's answer, for _view_index
        self._view_index: ParamIndex | None = None

    # ---- what the addresses cannot show ------------------------------------------------------
    def current_index(self) -> ParamIndex:
        """The params' index, after dropping every plan when the state, a param list or a
        group's ``plan_key`` changed since :meth:`record_structure` (O(groups))."""
        if self._structure is None or changed(self._structure, self.client):
            self._structure = None
            self.generation = next(_generations)
            self._entries.clear()
            self._checks.clear()
            self._reindex()
        return self.index

    def capture_view(self) -> CaptureView:
        """The generation, device and params of the plans as they are (no check, no rebuild: a
        step's :meth:`current_index` does those), for a client that holds a CUDA graph of a step.
        The same object while the generation and the index are (a client asks before every
        replay: two comparisons instead of a new tuple, a microsecond)."""
        view = self._view
        if view is None or view.generation != self.generation or self._view_index is not self.index:
            index = self._view_index = self.index
            view = self._view = (CaptureView(self.generation, None, ()) if index is None
                                 else CaptureView(self.generation, index.device, index.params))
        return view

    def record_structure(self) -> None:
        """Take the state and param lists as they are now as the ones the plans hold for (after
        a build or a torch-path step, which create state)."""
        self._structure = snapshot(self.client)

    def _reindex(self) -> None:
        self.client.track_mutations()
        self.index = ParamIndex(self.client.param_groups, type(self.client).__name__)

    # ---- addresses ---------------------------------------------------------------------------
    def lookup(self, device: torch.device) -> tuple[CachedPlan, bool] | None:
        """``(entry, hot)``: the plan to launch on ``device`` now (call :meth:`current_index`
        first). ``hot``: the cached plan, every address where it expects it (its grad column
        patched when only grads moved); else a plan built now, after the params and grads are
        validated. None when the params moved to other devices: the caller starts over."""
        entry = self._hot_plan(device)
        if entry is not None:
            return entry, True
        entry = self._build(device)
        return None if entry is None else (entry, False)

    def _hot_plan(self, device: torch.device) -> CachedPlan | None:
        """The cached entry when params, grads and EMA tensors sit where it expects them: two
        address lists compared (the grads', then the params' and EMA tensors' together), the
        whole check for yolov5n's 219 params and 358 EMA tensors. When only the grads moved
        (``zero_grad(set_to_none=True)``, then a backward that allocated elsewhere: most steps
        of a real run) and kept their layouts, their column is patched and the plan kept."""
        entry = self._entries.get(device)
        if entry is None or entry.volatile:
            return None
        try:
            grads = list(map(_grad, entry.grad_params))
            if entry.dtensors:
                grads = locals_of(grads)
            grad_addresses = list(map(_data_ptr, grads))
        except (TypeError, RuntimeError):  # a grad became None, or sparse
            return None
        if entry.addresses(entry.param_and_ema_tensors) != entry.param_and_ema_addresses:
            return None
        for p in entry.gradless_params:  # frozen params: usually none, or a few
            if p.grad is not None:
                return None
        if entry.ema_source is not self.client.ema_tensors():  # EMA attached, detached or re-paired
            return None
        if grad_addresses != entry.grad_addresses:
            if not patch_grads(entry.plan, grads, grad_addresses):
                return None
            entry.grad_addresses = grad_addresses
        return entry

    def _build(self, device: torch.device) -> CachedPlan | None:
        """A new plan for ``device``, after the params and grads are validated (a clear error
        before anything is modified), or None when the params' devices changed since the index
        was made (the new index is kept)."""
        client, old = self.client, self.index
        grads = [p.grad for p in old.params]
        self._reindex()
        index = self.index
        index.validate(client, grads, kernels=True)
        if index.devices != old.devices:
            return None
        idx = index.devices[device]
        plan = build_plan(client, index, device, grads)
        # the EMA's tensors once the build laid them out like their sources, less this optimizer's
        # params (yolov5n: 503 addresses a check instead of 716)
        ema_source = client.ema_tensors()
        params = index.params
        ema_tensors = []
        if ema_source is not None:
            ids = {id(p) for p in params}
            ema_tensors = [t for t in ema_source if id(t) not in ids]
        entry = CachedPlan(plan, [params[i] for i in idx], [grads[i] for i in idx], ema_tensors, ema_source,
                           index.dtensors or any(map(is_dtensor, ema_tensors)))
        self._entries[device] = entry
        self.generation = next(_generations)
        self.record_structure()
        return entry

    def get(self, device: torch.device) -> CachedPlan | None:
        """The cached entry of ``device`` as it is, unchecked (for tests and benchmarks)."""
        return self._entries.get(device)

    # ---- GradScaler's check, reused by the step right after it -------------------------------
    def mark_checked(self, device: torch.device, grad_scale: torch.Tensor, entry: CachedPlan) -> None:
        """``entry`` was just looked up and its grads checked with ``grad_scale`` (the statistics
        pass of :meth:`MultiTensorEngine.check_grads`): the next step launches on it as is."""
        self._checks[device] = (grad_scale, entry)

    def take_check(self, device: torch.device) -> tuple[torch.Tensor, CachedPlan] | None:
        """``(grad_scale, entry)`` of :meth:`mark_checked` when ``entry`` is still the device's
        plan, consumed; else None."""
        if not self._checks:
            return None
        check = self._checks.pop(device, None)
        if check is None or check[1] is not self._entries.get(device):
            return None
        return check

    def peek_check(self, device: torch.device) -> tuple[torch.Tensor, CachedPlan] | None:
        """What :meth:`take_check` would return, left in place."""
        check = self._checks.get(device)
        if check is None or check[1] is not self._entries.get(device):
            return None
        return check

    def forget_checks(self) -> None:
        """Drop a :meth:`mark_checked` result no step consumed."""
        self._checks.clear()


__all__ = ["CachedPlan", "CaptureView", "PlanCache"]
