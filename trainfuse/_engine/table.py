"""Host side of the multi-tensor engine: pointer tables, caching, hyperparameters, launch.

Per device the engine keeps a *plan*: an int64 row per tensor (operand addresses, numel, group,
dtype, step address) and one work item per (tensor, chunk), both on the device. A plan is keyed by
the data pointers of the params and grads, so it survives ``zero_grad(set_to_none=True)`` as long
as the caching allocator hands the grads back at the same addresses (it usually does); anything
else (a new param layout, ``load_state_dict``, ``add_param_group``, a grad that became ``None``)
rebuilds it. Per-group hyperparameters live in a float64 device table that is re-uploaded only when
a value changes, so LR schedules neither recompile nor synchronize.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import TYPE_CHECKING

import torch

from trainfuse._backend import use_triton
from trainfuse._engine import kernels
from trainfuse._engine.launch import CachedLauncher

if TYPE_CHECKING:
    from trainfuse.optim._base import FusedOptimizer

_grad = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the row layout the kernels read (trainfuse/_engine/kernels.py)
ROW = kernels.ROW.value
MAX_OPERANDS = kernels.COL_STEP.value  # param, grad and up to four states precede the step column
assert [c.value for c in (kernels.COL_STEP, kernels.COL_NUMEL, kernels.COL_GROUP, kernels.COL_DTYPE,
                          kernels.COL_NCHUNKS)] == list(range(MAX_OPERANDS, MAX_OPERANDS + 5))


@dataclasses.dataclass
class LaunchConfig:
    """Elements per loop iteration (``block``), iterations per program (``unroll``) and warps per
    program; a work item is ``block * unroll`` elements. Tests shrink ``block`` so that small
    tensors span several work items."""

    # From `python -m trainfuse.bench optim --sweep` (torch 2.11, triton 3.6): 512-element blocks,
    # 8 per program (a 4096-element work item), 4 warps was the best or within 2% of it for GPT-2
    # AdamW and SGD on both the H100 and the H200 (AdamW 96% / 91% of copy bandwidth), and among
    # the best for the 216-tensor layout on the H200; deeper prefetch matters most for AdamW.
    block: int = 512
    unroll: int = 8
    num_warps: int = 4

    @property
    def chunk(self) -> int:
        return self.block * self.unroll


def _config_from_env() -> LaunchConfig:
    """``TRAINFUSE_LAUNCH=BLOCKxUNROLLxWARPS`` (e.g. ``512x8x4``) overrides the defaults, for tuning
    on other GPUs with ``python -m trainfuse.bench optim --sweep``."""
    spec = os.environ.get("TRAINFUSE_LAUNCH", "")
    if not spec:
        return LaunchConfig()
    try:
        block, unroll, warps = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"TRAINFUSE_LAUNCH={spec!r}: expected BLOCKxUNROLLxWARPS, e.g. 512x8x4") from None
    if block & (block - 1) or block < 16 or unroll < 1 or warps & (warps - 1):
        raise ValueError(f"TRAINFUSE_LAUNCH={spec!r}: block and warps must be powers of two, block >= 16")
    return LaunchConfig(block, unroll, warps)


config = _config_from_env()


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers its memory without gaps or overlap, whatever the dim order."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when element k of ``a``'s memory is element k of ``b``'s (both dense, same order)."""
    if a.stride() == b.stride():
        return True
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def conform(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s dtype, device and memory layout (a copy only where needed)."""
    if t.dtype == like.dtype and t.device == like.device and same_layout(t, like):
        return t
    out = torch.empty_like(like)
    out.copy_(t)
    return out


class _Plan:
    __slots__ = ("pkey", "gkey", "host", "rows", "chunks", "arrivals", "nchunks", "ntensors",
                 "dtypes", "aligned", "volatile", "keepalive", "copy_back", "slots", "gstrides")


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class MultiTensorEngine:
    """Runs one optimizer's step over all its params: Triton plans per device, or the torch path."""

    def __init__(self, client: FusedOptimizer):
        self.client = client
        self.invalidate()

    def invalidate(self) -> None:
        """Forget every table (param groups, states or layouts changed)."""
        self._launcher = CachedLauncher()
        self._indexed = False
        self._plans: dict[torch.device, _Plan] = {}
        self._hp: dict[torch.device, tuple[list[float], torch.Tensor]] = {}

    # ---- indexing and validation -------------------------------------------------------------
    def _index(self) -> None:
        groups = self.client.param_groups
        self._params = [p for g in groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
        devices: dict[torch.device, list[int]] = {}
        for i, p in enumerate(self._params):
            devices.setdefault(p.device, []).append(i)
        self._devices = devices
        self._single = len(devices) == 1
        self._indexed = True

    def _fail(self, i: int, what: str, exc: type[Exception] = ValueError) -> None:
        p = self._params[i]
        raise exc(
            f"{type(self.client).__name__}: param {i} (group {self._group_of[i]}, shape "
            f"{tuple(p.shape)}, {p.dtype}, {p.device}) {what}"
        )

    def validate(self, grads: list[torch.Tensor | None], kernels: bool) -> None:
        """Raise a clear error for the first unusable param/grad, before anything is modified."""
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

    # ---- the step ------------------------------------------------------------------------------
    def step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        if not self._indexed:
            self._index()
        params = self._params
        if self._single:
            (device,) = self._devices
            if use_triton(device):
                plan = self._plans.get(device)
                if plan is not None and not plan.volatile:
                    # the hot path: one pass over the params, then launch
                    try:
                        gkey = list(map(_data_ptr, map(_grad, params)))
                    except (TypeError, RuntimeError):  # a None or sparse grad
                        gkey = None
                    if gkey == plan.gkey and list(map(_data_ptr, params)) == plan.pkey:
                        self._launch(device, plan, grad_scale, found_inf)
                        return
                grads = [p.grad for p in params]
                self._triton_step(device, None, grads, grad_scale, found_inf)
            else:
                grads = [p.grad for p in params]
                self._torch_step(device, range(len(params)), grads, grad_scale, found_inf)
            return
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

    # ---- torch path ----------------------------------------------------------------------------
    def _torch_step(self, device, idx, grads, grad_scale, found_inf) -> None:
        self.validate(grads, kernels=False)
        if found_inf is not None and float(found_inf) != 0.0:  # the reference path may sync
            return
        groups = self.client.param_groups
        by_group: dict[int, tuple[list, list]] = {}
        for i in idx:
            g = grads[i]
            if g is None:
                continue
            ps, gs = by_group.setdefault(self._group_of[i], ([], []))
            ps.append(self._params[i])
            gs.append(g)
        with torch.no_grad():
            for gi, (ps, gs) in by_group.items():
                if grad_scale is not None:  # like torch's fused kernels, leave the grads unscaled
                    torch._foreach_div_(gs, grad_scale.to(gs[0].device))
                self.client._torch_group_step(groups[gi], ps, gs)

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

    def _plan_valid(self, device, idx, grads) -> bool:
        plan = self._plans.get(device)
        if plan is None or plan.volatile:
            return False
        try:
            pkey, gkey = self._keys(idx, grads)
        except RuntimeError:  # e.g. a sparse grad has no data pointer
            return False
        return pkey == plan.pkey and gkey == plan.gkey

    def _triton_step(self, device, idx, grads, grad_scale, found_inf) -> None:
        plan = self._plans.get(device)
        try:
            pkey, gkey = self._keys(idx, grads)
        except RuntimeError:
            pkey = gkey = None
        if plan is None or plan.volatile or pkey != plan.pkey or gkey != plan.gkey:
            if not self._refresh_grads(plan, pkey, gkey, idx, grads):
                if idx is None:  # single-device path: re-check what the key cannot see
                    self._index()
                    self.validate(grads, kernels=True)
                    if not self._single or device not in self._devices:  # params moved devices
                        self.step(grad_scale, found_inf)
                        return
                plan = self._build(device, idx, grads)
                plan.pkey, plan.gkey = self._keys(idx, grads)
                self._plans[device] = plan
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
        # autograd and the .grad setter pin dtype, shape and device; the layout is all that can
        # still differ (a user-assigned grad), and the plan assumed the param's
        if [g.stride() for g in live] != plan.gstrides:
            return False
        addrs = torch.tensor([g.data_ptr() for g in live], dtype=torch.int64)
        plan.aligned = plan.aligned and bool((addrs % 16 == 0).all())
        plan.host[: plan.ntensors * ROW].view(plan.ntensors, ROW)[:, 1] = addrs
        self._place(plan, plan.host, plan.rows.device)
        plan.gkey = gkey
        return True

    def _launch(self, device, plan, grad_scale, found_inf) -> None:
        if plan.nchunks == 0:
            return
        hp = self._hparams(device)
        if grad_scale is not None and grad_scale.device != device:
            grad_scale = grad_scale.to(device, non_blocking=True)
        if found_inf is not None and found_inf.device != device:
            found_inf = found_inf.to(device, non_blocking=True)
        self._launcher(
            self.client._kernel, (plan.nchunks,), plan.rows, plan.chunks, hp, plan.arrivals,
            hp if grad_scale is None else grad_scale, hp if found_inf is None else found_inf,
            BLOCK=config.block, NB=config.unroll, DTYPES=plan.dtypes, ALIGNED=plan.aligned,
            HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
            WIDTH=self.client.HP_WIDTH, num_warps=config.num_warps,
        )
        if grad_scale is not None:
            for g, tmp in plan.copy_back:
                g.copy_(tmp)

    def _hparams(self, device) -> torch.Tensor:
        values: list[float] = []
        tensors = []
        width = self.client.HP_WIDTH
        for group in self.client.param_groups:
            row = self.client._hparams(group)
            for v in row:
                if isinstance(v, torch.Tensor):
                    tensors.append((len(values), v))
                    values.append(0.0)
                else:
                    values.append(float(v))
            values.extend([0.0] * (width - len(row)))  # rows are HP_WIDTH wide in the kernel
        cached = self._hp.get(device)
        if cached is None or cached[0] != values:
            self.client._check_hparams()
            hp = _upload(torch.tensor(values, dtype=torch.float64), device)
            self._hp[device] = (values, hp)
        else:
            hp = cached[1]
        for k, t in tensors:  # tensor hyperparameters (e.g. a CUDA lr): device copy, no sync
            hp[k : k + 1].copy_(t.reshape(1), non_blocking=True)
        return hp

    def _build(self, device, idx, grads) -> _Plan:
        client = self.client
        groups = client.param_groups
        plan = _Plan()
        plan.volatile = False
        plan.keepalive = []
        plan.copy_back = []
        rows: list[list[int]] = []
        numels: list[int] = []
        plan.slots = []
        plan.gstrides = []
        aligned = True
        dtypes = 0
        for pos, i in enumerate(idx if idx is not None else range(len(self._params))):
            g = grads[i]
            if g is None:
                continue
            p = self._params[i]
            group = groups[self._group_of[i]]
            states, step = client._prepare_state(p, group, kernels=True)
            if not same_layout(g, p):  # e.g. a contiguous grad for a channels_last weight
                tmp = conform(g, p)
                plan.keepalive.append(tmp)
                plan.copy_back.append((g, tmp))
                plan.volatile = True
                g = tmp
            addrs = [t.data_ptr() for t in (p, g, *states)]
            aligned = aligned and all(a % 16 == 0 for a in addrs)
            numel = p.numel()
            nchunks = max(1, -(-numel // config.chunk))  # empty tensors still count a step
            code = DTYPE_CODES[p.dtype]
            dtypes |= 1 << code
            row = addrs + [0] * (MAX_OPERANDS - len(addrs))
            row += [step.data_ptr(), numel, self._group_of[i], code, nchunks]
            rows.append(row + [0] * (ROW - len(row)))
            numels.append(nchunks)
            plan.slots.append(pos)
            plan.gstrides.append(grads[i].stride())
        plan.dtypes = dtypes
        plan.aligned = aligned
        plan.ntensors = ntensors = len(rows)
        if ntensors == 0:
            plan.nchunks = 0
            return plan
        counts = torch.tensor(numels, dtype=torch.int64)
        total = int(counts.sum())
        tensor_of = torch.repeat_interleave(torch.arange(ntensors, dtype=torch.int64), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        items = (tensor_of << 32) | (torch.arange(total, dtype=torch.int64) - first)
        plan.host = torch.cat([torch.tensor(rows, dtype=torch.int64).flatten(), items])
        plan.nchunks = total
        self._place(plan, plan.host, device)
        plan.arrivals = torch.zeros(ntensors, dtype=torch.int32, device=device)
        return plan

    @staticmethod
    def _place(plan, host, device) -> None:
        """Upload the tables (a fresh device buffer: the previous launch may still read the old)."""
        buf = _upload(host, device) if device.type != "cpu" else host.clone()
        plan.rows = buf[: plan.ntensors * ROW]
        plan.chunks = buf[plan.ntensors * ROW :]


__all__ = ["DTYPE_CODES", "LaunchConfig", "MultiTensorEngine", "config", "conform", "is_dense",
           "same_layout"]
