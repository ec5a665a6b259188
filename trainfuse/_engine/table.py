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
MAX_OPERANDS = kernels.COL_STEP.value  # operand slots precede the step column
COL_NCHUNKS = kernels.COL_NCHUNKS.value
assert [c.value for c in (kernels.COL_STEP, kernels.COL_NUMEL, kernels.COL_GROUP, kernels.COL_CODE,
                          kernels.COL_NCHUNKS)] == list(range(MAX_OPERANDS, MAX_OPERANDS + 5))
OP_PARAM, OP_GRAD, OP_MASTER, OP_EMA, OP_STATE = (k.value for k in (
    kernels.OP_PARAM, kernels.OP_GRAD, kernels.OP_MASTER, kernels.OP_EMA, kernels.OP_STATE))
CODE_MASTER, CODE_EMA, CODE_EMA_LOW, CODE_EMA_ONLY = (k.value for k in (
    kernels.CODE_MASTER, kernels.CODE_EMA, kernels.CODE_EMA_LOW, kernels.CODE_EMA_ONLY))
NORM_KINDS = {1.0: kernels.NORM_L1.value, 2.0: kernels.NORM_L2.value,
              float("inf"): kernels.NORM_INF.value}


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


def _config_from_env(default: LaunchConfig) -> LaunchConfig:
    """``TRAINFUSE_LAUNCH=BLOCKxUNROLLxWARPS`` (e.g. ``512x8x4``) overrides the defaults (of plans
    with and without float32 masters alike), for tuning on other GPUs with
    ``python -m trainfuse.bench optim --sweep``."""
    spec = os.environ.get("TRAINFUSE_LAUNCH", "")
    if not spec:
        return default
    try:
        block, unroll, warps = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"TRAINFUSE_LAUNCH={spec!r}: expected BLOCKxUNROLLxWARPS, e.g. 512x8x4") from None
    if block & (block - 1) or block < 16 or unroll < 1 or warps & (warps - 1):
        raise ValueError(f"TRAINFUSE_LAUNCH={spec!r}: block and warps must be powers of two, block >= 16")
    return LaunchConfig(block, unroll, warps)


config = _config_from_env(LaunchConfig())
# plans with float32-master rows (fuse_casts): GPT-2 bf16 AdamW on the H200 (torch 2.11, triton
# 3.6) took 0.883 ms (93% of the floor) at 512 x 4 x 4 with vector accesses and the 2-ulp division
# and square root, against 0.915 at 512 x 8 x 4 and 0.956 or more for every wider shape
master_config = _config_from_env(LaunchConfig(512, 4, 4))


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
    __slots__ = ("pkey", "gkey", "ekey", "host", "rows", "chunks", "arrivals", "nchunks", "ngrad", "launch",
                 "ntensors", "codes", "pds", "aligned", "volatile", "keepalive", "copy_back", "slots",
                 "gstrides", "partials", "flags", "counter", "with_grad", "without_grad", "hot_gkey",
                 "fixed", "fixed_key", "eflat", "tkey")


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class RowBuilder:
    """Collects one row per tensor (operand addresses by slot, numel, group, row code, step) and
    turns them into a device plan. Rows that carry a gradient must come before EMA-only rows: the
    gradient-statistics pass walks only the first ``ngrad`` work items. The launch shape (and with
    it the chunk size) is the plan's: :data:`master_config` when any row has a float32 master."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.numels: list[int] = []
        self.aligned = True
        self.codes = 0
        self.pds = 0
        self.grad_rows = 0

    def add(self, operands: dict[int, torch.Tensor | None], numel: int, code: int, group: int = 0,
            step: torch.Tensor | None = None) -> None:
        slots = [0] * MAX_OPERANDS
        for k, t in operands.items():
            if t is not None:
                slots[k] = t.data_ptr()
                self.aligned = self.aligned and slots[k] % 16 == 0
        row = slots + [0 if step is None else step.data_ptr(), numel, group, code, 0]  # + nchunks
        self.rows.append(row + [0] * (ROW - len(row)))
        self.numels.append(numel)
        self.codes |= 1 << code
        if not code & CODE_EMA_ONLY:
            assert self.grad_rows == len(self.rows) - 1, "gradient rows go first"
            self.pds |= 1 << (code % 4)
            self.grad_rows += 1

    def launch(self) -> LaunchConfig:
        masters = any(self.codes >> c & 1 for c in range(kernels.NCODES.value) if c & CODE_MASTER)
        return master_config if masters else config

    def build(self, device: torch.device) -> _Plan:
        plan = _Plan()
        plan.launch = launch = self.launch()
        nchunks = [max(1, -(-n // launch.chunk)) for n in self.numels]  # empty tensors count a step
        for row, k in zip(self.rows, nchunks):
            row[COL_NCHUNKS] = k
        self.ngrad = sum(nchunks[: self.grad_rows])
        plan.volatile = False
        plan.with_grad, plan.without_grad, plan.hot_gkey = [], [], None
        plan.fixed, plan.fixed_key, plan.eflat = [], None, None
        plan.keepalive = []
        plan.copy_back = []
        plan.codes, plan.pds, plan.aligned, plan.ngrad = self.codes, self.pds, self.aligned, self.ngrad
        plan.ntensors = ntensors = len(self.rows)
        plan.partials = plan.flags = plan.counter = plan.tkey = None
        if ntensors == 0:
            plan.nchunks = 0
            return plan
        counts = torch.tensor(nchunks, dtype=torch.int64)
        total = int(counts.sum())
        tensor_of = torch.repeat_interleave(torch.arange(ntensors, dtype=torch.int64), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        items = (tensor_of << 32) | (torch.arange(total, dtype=torch.int64) - first)
        plan.host = torch.cat([torch.tensor(self.rows, dtype=torch.int64).flatten(), items])
        plan.nchunks = total
        place(plan, plan.host, device)
        plan.arrivals = torch.zeros(ntensors, dtype=torch.int32, device=device)
        return plan


def place(plan: _Plan, host: torch.Tensor, device: torch.device) -> None:
    """Upload the tables (a fresh device buffer: the previous launch may still read the old)."""
    buf = _upload(host, device) if device.type != "cpu" else host.clone()
    plan.rows = buf[: plan.ntensors * ROW]
    plan.chunks = buf[plan.ntensors * ROW :]
    plan.tkey = None


def code_of(dtype: torch.dtype, master: bool = False, ema: torch.Tensor | None = None,
            ema_only: bool = False) -> int:
    """Row code of a tensor of ``dtype`` (see kernels.py); raises TypeError for an EMA dtype the
    kernels do not pair with it (the EMA must be float32 or the tensor's own dtype)."""
    code = DTYPE_CODES[dtype] | (CODE_MASTER if master else 0)
    if ema is not None:
        code |= CODE_EMA_ONLY if ema_only else CODE_EMA
        if ema.dtype == dtype and dtype != torch.float32:
            code |= CODE_EMA_LOW
        elif ema.dtype != torch.float32:
            raise TypeError(f"an EMA tensor of {ema.dtype} cannot follow a {dtype} tensor; "
                            "keep the EMA in float32 or in the tensor's dtype")
    return code


def _ptr_class(t: torch.Tensor | None) -> tuple | None:
    """What Triton specializes a pointer argument on: its element type and 16-byte alignment."""
    return None if t is None else (t.dtype, t.data_ptr() % 16 == 0)


def _tables_key(plan: _Plan) -> tuple:
    """The part of a launch's cache key that the plan fixes: its own buffers' alignment (made by
    the allocator: aligned, but the chunk table starts after the rows), the element-alignment
    flag and the launch shape. Passed as ``key=``, it spares the launcher keying every argument
    and constexpr on every step (a tenth of the yolov5n optimizer phase's host time). Kept on the
    plan until :func:`place` uploads new tables."""
    if plan.tkey is None:
        launch = plan.launch
        plan.tkey = (plan.rows.data_ptr() % 16 == 0, plan.chunks.data_ptr() % 16 == 0,
                     plan.arrivals.data_ptr() % 16 == 0, plan.aligned, launch.block, launch.unroll,
                     launch.num_warps)
    return plan.tkey


def launch_update(launcher: CachedLauncher, kernel, plan: _Plan, hp: torch.Tensor | None = None, *,
                  grad_scale: torch.Tensor | None = None, clip: torch.Tensor | None = None,
                  found_inf: torch.Tensor | None = None, ema_w: float = 0.0, width: int = 8) -> None:
    """One launch of a multi-tensor update kernel (``kernels.run`` signature) over ``plan``."""
    if plan.nchunks == 0:
        return
    dummy = plan.rows  # stands in for absent pointers; never read (the HAS_* flags are off)
    launch = plan.launch
    key = ("update", _tables_key(plan), plan.codes, _ptr_class(hp), _ptr_class(grad_scale), _ptr_class(clip),
           _ptr_class(found_inf), width)
    launcher(
        kernel, (plan.nchunks,), plan.rows, plan.chunks, dummy if hp is None else hp, plan.arrivals,
        dummy if grad_scale is None else grad_scale, dummy if clip is None else clip,
        dummy if found_inf is None else found_inf, float(ema_w),
        BLOCK=launch.block, NB=launch.unroll, CODES=plan.codes, ALIGNED=plan.aligned,
        HAS_SCALE=grad_scale is not None, HAS_CLIP=clip is not None,
        HAS_INF=found_inf is not None, WIDTH=width, num_warps=launch.num_warps, key=key,
    )


def launch_stats(launcher: CachedLauncher, plan: _Plan, out: torch.Tensor, *,
                 grad_scale: torch.Tensor | None = None, max_norm: float = 0.0,
                 norm_type: float | None = None) -> None:
    """One launch of the gradient-statistics pass: ``out[0:3] = [norm of grad / grad_scale,
    clip coefficient for max_norm, 1.0 if any grad is inf/NaN]`` (norm_type None: the check only)."""
    if plan.ngrad == 0:  # no gradient this step: norm 0, nothing to clip, nothing non-finite
        out[:3].copy_(torch.tensor([0.0, 1.0, 0.0]), non_blocking=True)
        return
    if plan.partials is None:
        device = plan.rows.device
        plan.partials = torch.empty(plan.ngrad, dtype=torch.float32, device=device)
        plan.flags = torch.empty(plan.ngrad, dtype=torch.int32, device=device)
        plan.counter = torch.tensor([0, plan.ngrad], dtype=torch.int32).to(device)
    norm = kernels.NORM_NONE.value if norm_type is None else NORM_KINDS[float(norm_type)]
    launch = plan.launch
    key = ("stats", _tables_key(plan), plan.pds, _ptr_class(grad_scale), _ptr_class(out), norm)
    launcher(
        kernels.grad_stats_kernel, (plan.ngrad,), plan.rows, plan.chunks,
        plan.rows if grad_scale is None else grad_scale, plan.partials, plan.flags, plan.counter,
        out, float(max_norm),
        BLOCK=launch.block, NB=launch.unroll, PDS=plan.pds, ALIGNED=plan.aligned,
        HAS_SCALE=grad_scale is not None, NORM=norm, num_warps=launch.num_warps, key=key,
    )


class MultiTensorEngine:
    """Runs one optimizer's step over all its params: Triton plans per device, or the torch path.

    Besides the update itself the step can clip the gradients to a global norm (the client's
    ``max_grad_norm``: one statistics launch before the update, or none when GradScaler already
    ran it through :meth:`check_grads`), keep float32 masters of 16-bit params (row code MASTER)
    and fold an attached EMA into the update (EMA rows, plus EMA-only rows for buffers).
    """

    def __init__(self, client: FusedOptimizer):
        self.client = client
        self.invalidate()

    def invalidate(self) -> None:
        """Forget every table (param groups, states or layouts changed)."""
        self._launcher = CachedLauncher()
        self._indexed = False
        self._plans: dict[torch.device, _Plan] = {}
        self._hp: dict[torch.device, tuple[list[float], torch.Tensor]] = {}
        self._stats: dict[torch.device, torch.Tensor] = {}
        self._clip_view: torch.Tensor | None = None
        # device -> (grad_scale, plan) of a statistics pass GradScaler ran just before the step
        self._checked: dict[torch.device, tuple[torch.Tensor, _Plan]] = {}
        self._ekey_flat = None  # the EMA pair list _ekey_tensors was made from

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
        self._ekey_flat = None

    def _fail(self, i: int, what: str, exc: type[Exception] = ValueError) -> None:
        p = self._params[i]
        raise exc(
            f"{type(self.client).__name__}: param {i} (group {self._group_of[i]}, shape "
            f"{tuple(p.shape)}, {p.dtype}, {p.device}) {what}"
        )

    def validate(self, grads: list[torch.Tensor | None], kernels: bool) -> None:
        """Raise a clear error for the first unusable param/grad, before anything is modified."""
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

    # ---- the step ------------------------------------------------------------------------------
    def _hot_plan(self, device) -> _Plan | None:
        """The cached plan when params, grads and EMA tensors sit where it expects them: two
        address lists compared (the grads', then the params' and EMA tensors' together), the
        whole check for yolov5n's 219 params and 358 EMA tensors."""
        plan = self._plans.get(device)
        if plan is None or plan.volatile or plan.fixed_key is None:
            return None
        try:
            if list(map(_data_ptr, map(_grad, plan.with_grad))) != plan.hot_gkey:
                return None
        except (TypeError, RuntimeError):  # a grad became None, or sparse
            return None
        if list(map(_data_ptr, plan.fixed)) != plan.fixed_key:
            return None
        for p in plan.without_grad:  # frozen params: usually none, or a few
            if p.grad is not None:
                return None
        if plan.eflat is not self.client._ema_all_pairs():  # EMA attached, detached or re-paired
            return None
        return plan

    def step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        if not self._indexed:
            self._index()
        params = self._params
        if self._single:
            (device,) = self._devices
            checked = self._checked.get(device)
            if checked is not None and checked[1] is self._plans.get(device):
                # GradScaler's check_grads just validated the plan (and the backend) for this step
                self._launch(device, checked[1], grad_scale, found_inf)
                return
            if use_triton(device):
                plan = self._hot_plan(device)
                if plan is not None:  # the hot path: one pass over the params, then launch
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

    def check_grads(self, grad_scale: torch.Tensor) -> dict[torch.device, torch.Tensor] | None:
        """GradScaler's inf/NaN check, run by the statistics pass the step needs anyway (it also
        takes the clipping norm): returns ``{device: found_inf}``, or None where this engine cannot
        (params on several devices or on the torch path: the caller then checks as torch does)."""
        if not self._indexed:
            self._index()
        if not self._single:
            return None
        (device,) = self._devices
        if not use_triton(device):
            return None
        plan = self._hot_plan(device)
        if plan is None:
            grads = [p.grad for p in self._params]
            plan = self._plan_for(device, None, grads)
            if plan is None:
                return None
        if grad_scale.device != device:
            grad_scale = grad_scale.to(device, non_blocking=True)
        out = self._stats_out(device)
        launch_stats(self._launcher, plan, out, grad_scale=grad_scale,
                     max_norm=self.client.max_grad_norm or 0.0,
                     norm_type=None if self.client.max_grad_norm is None else 2.0)
        self._checked[device] = (grad_scale, plan)
        return {device: out[2]}

    def forget_check(self) -> None:
        """Drop a :meth:`check_grads` result the step did not consume (the step raised): the next
        step must validate its grads again."""
        self._checked.clear()

    def _clip_of(self, out: torch.Tensor) -> torch.Tensor:
        """``out[1:2]``, the clip coefficient the update reads, made once (a view costs ~2 us)."""
        clip = self._clip_view
        if clip is None or clip._base is not out:
            clip = self._clip_view = out[1:2]
        return clip

    def _stats_out(self, device) -> torch.Tensor:
        out = self._stats.get(device)
        if out is None:
            out = self._stats[device] = torch.zeros(4, dtype=torch.float32, device=device)
        return out

    def grad_norm(self) -> torch.Tensor | None:
        """Total gradient norm taken by the last clipping step (a device tensor, no sync)."""
        for out in self._stats.values():
            return out[0]
        return None

    # ---- torch path ----------------------------------------------------------------------------
    def _torch_step(self, device, idx, grads, grad_scale, found_inf) -> None:
        self.validate(grads, kernels=False)
        client = self.client
        skip = found_inf is not None and float(found_inf) != 0.0  # the reference path may sync
        groups = client.param_groups
        by_group: dict[int, tuple[list, list, list]] = {}
        all_grads = []
        for i in idx:
            g = grads[i]
            if g is None:
                continue
            ps, gs, ms = by_group.setdefault(self._group_of[i], ([], [], []))
            ps.append(self._params[i])
            gs.append(g)
            all_grads.append(g)
        with torch.no_grad():
            if not skip:
                if grad_scale is not None and all_grads:  # like torch's fused kernels, leave the
                    torch._foreach_div_(all_grads, grad_scale.to(device))  # grads unscaled
                if client.max_grad_norm is not None and all_grads:
                    total = torch.nn.utils.clip_grad_norm_(all_grads, client.max_grad_norm)
                    self._stats_out(device)[0].copy_(total)
                for gi, (ps, gs, _) in by_group.items():
                    masters = [client._master_of(p, groups[gi]) for p in ps]
                    if any(m is not None for m in masters):  # float32 math on the masters
                        ws = [p if m is None else m for p, m in zip(ps, masters)]
                        gs32 = [g if m is None else g.float() for g, m in zip(gs, masters)]
                        client._torch_group_step(groups[gi], ps, gs32, ws)
                        for p, m in zip(ps, masters):
                            if m is not None:
                                p.copy_(m)
                    else:
                        client._torch_group_step(groups[gi], ps, gs, ps)
            ema_w = client._ema_w
            if ema_w is not None:
                ema, src = [], []
                for e, t in client._ema_pairs(device):
                    ema.append(e)
                    src.append(t)
                if ema:
                    torch._foreach_lerp_(ema, src, ema_w)

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
        flat = self.client._ema_all_pairs()
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
        return pkey == plan.pkey and gkey == plan.gkey and plan.ekey == self._ema_key()

    def _plan_for(self, device, idx, grads) -> _Plan | None:
        """The plan for this step: cached, grad column patched, or rebuilt. None when the params
        moved to other devices (the caller starts over)."""
        plan = self._plans.get(device)
        try:
            pkey, gkey = self._keys(idx, grads)
        except RuntimeError:
            pkey = gkey = None
        ekey = self._ema_key()
        if plan is None or plan.volatile or pkey != plan.pkey or gkey != plan.gkey or ekey != plan.ekey:
            if ekey != getattr(plan, "ekey", None) or not self._refresh_grads(plan, pkey, gkey, idx, grads):
                if idx is None:  # single-device path: re-check what the key cannot see
                    self._index()
                    self.validate(grads, kernels=True)
                    if not self._single or device not in self._devices:  # params moved devices
                        return None
                plan = self._build(device, idx, grads)
                plan.pkey, plan.gkey = self._keys(idx, grads)
                plan.ekey = ekey
                self._plans[device] = plan
        if idx is None:  # what the single-device hot path compares
            plan.with_grad = [p for p, g in zip(self._params, grads) if g is not None]
            plan.without_grad = [p for p, g in zip(self._params, grads) if g is None]
            plan.hot_gkey = [g.data_ptr() for g in grads if g is not None]
            plan.eflat = self.client._ema_all_pairs()
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
        # autograd and the .grad setter pin dtype, shape and device; the layout is all that can
        # still differ (a user-assigned grad), and the plan assumed the param's
        if [g.stride() for g in live] != plan.gstrides:
            return False
        addrs = torch.tensor([g.data_ptr() for g in live], dtype=torch.int64)
        plan.aligned = plan.aligned and bool((addrs % 16 == 0).all())
        plan.host[: plan.ntensors * ROW].view(plan.ntensors, ROW)[: len(live), OP_GRAD] = addrs
        place(plan, plan.host, plan.rows.device)
        plan.gkey = gkey
        return True

    def _launch(self, device, plan, grad_scale, found_inf) -> None:
        client = self.client
        checked = self._checked.pop(device, None)
        if plan.nchunks == 0:
            return
        hp = self._hparams(device)
        if grad_scale is not None and grad_scale.device != device:
            grad_scale = grad_scale.to(device, non_blocking=True)
        if found_inf is not None and found_inf.device != device:
            found_inf = found_inf.to(device, non_blocking=True)
        clip = None
        if client.max_grad_norm is not None:
            out = self._stats_out(device)
            if checked is None or checked[0] is not grad_scale:  # GradScaler did not run it for us
                launch_stats(self._launcher, plan, out, grad_scale=grad_scale,
                             max_norm=client.max_grad_norm, norm_type=2.0)
            clip = self._clip_of(out)
        ema_w = client._ema_w
        launch_update(self._launcher, client._kernel, plan, hp, grad_scale=grad_scale, clip=clip,
                      found_inf=found_inf, ema_w=0.0 if ema_w is None else ema_w,
                      width=client.HP_WIDTH)
        if grad_scale is not None or clip is not None:
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
        builder = RowBuilder()
        keepalive, copy_back, slots, gstrides = [], [], [], []
        volatile = False
        with_row = set()
        for pos, i in enumerate(idx if idx is not None else range(len(self._params))):
            g = grads[i]
            if g is None:
                continue
            p = self._params[i]
            group = groups[self._group_of[i]]
            states, step, master = client._prepare_state(p, group, kernels=True)
            if not same_layout(g, p):  # e.g. a contiguous grad for a channels_last weight
                tmp = conform(g, p)
                keepalive.append(tmp)
                copy_back.append((g, tmp))
                volatile = True
                g = tmp
            ema = client._ema_of(p)
            operands = {OP_PARAM: p, OP_GRAD: g, OP_MASTER: master, OP_EMA: ema}
            operands.update({OP_STATE + k: t for k, t in enumerate(states)})
            code = code_of(p.dtype, master is not None, ema)
            builder.add(operands, p.numel(), code, self._group_of[i], step)
            with_row.add(p)
            slots.append(pos)
            gstrides.append(grads[i].stride())
        for ema, src in client._ema_pairs(device):
            if src not in with_row:  # buffers, frozen params, params without a grad this step
                builder.add({OP_PARAM: src, OP_EMA: ema}, src.numel(),
                            code_of(src.dtype, ema=ema, ema_only=True))
        plan = builder.build(device)
        plan.keepalive, plan.copy_back, plan.volatile = keepalive, copy_back, volatile
        plan.slots, plan.gstrides = slots, gstrides
        return plan


class TensorListPlans:
    """Plans for lists of tensors that are not an optimizer's params (clipping, FusedEMA), keyed by
    the tensors' addresses, sizes and dtypes, so a list seen again reuses its tables."""

    def __init__(self, size: int = 8) -> None:
        self._plans: dict[tuple, _Plan] = {}
        self._size = size
        self.launcher = CachedLauncher()

    def lookup(self, key: tuple) -> _Plan | None:
        return self._plans.get(key)

    def get(self, key: tuple, build) -> _Plan:
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self._size:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = build()
        return plan


__all__ = ["DTYPE_CODES", "LaunchConfig", "MultiTensorEngine", "RowBuilder", "TensorListPlans",
           "code_of", "config", "conform", "master_config", "is_dense", "launch_stats", "launch_update",
           "same_layout"]
