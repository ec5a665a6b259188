"""Host side of the multi-tensor tables: building them, and one launch over them.

A *plan* (:class:`Plan`) is an int64 row per tensor (operand addresses, step address, numel,
group, row code) and one work item per (tensor, chunk), both on the device (:class:`RowBuilder`
collects the rows, :class:`Plan` lays them out). :func:`launch_update` runs a client's chunk
function over every row in one launch; :func:`launch_stats` takes the gradient norm and inf/NaN
check in one launch. What a plan points at, and when it must be rebuilt, is its caller's
business: the optimizers' plan cache (``trainfuse/optim/plans.py``) and :class:`TensorListPlans`
(lists keyed by every tensor's address, size and dtype) both keep that promise.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from itertools import compress

import torch

from trainfuse._multi_tensor import kernels, stats
from trainfuse._runtime import compat, jit_keys
from trainfuse._runtime.launch import CachedLauncher

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the row layout the kernels read (trainfuse/_multi_tensor/kernels.py)
ROW = kernels.ROW.value
MAX_OPERANDS = kernels.COL_STEP.value  # operand slots precede the step column
COL_NCHUNKS = kernels.COL_NCHUNKS.value
assert [c.value for c in (kernels.COL_STEP, kernels.COL_NUMEL, kernels.COL_GROUP, kernels.COL_CODE,
                          kernels.COL_NCHUNKS)] == list(range(MAX_OPERANDS, MAX_OPERANDS + 5))
OP_PARAM, OP_GRAD, OP_MASTER, OP_EMA, OP_STATE = (k.value for k in (
    kernels.OP_PARAM, kernels.OP_GRAD, kernels.OP_MASTER, kernels.OP_EMA, kernels.OP_STATE))
CODE_MASTER, CODE_EMA, CODE_EMA_LOW, CODE_EMA_ONLY = (k.value for k in (
    kernels.CODE_MASTER, kernels.CODE_EMA, kernels.CODE_EMA_LOW, kernels.CODE_EMA_ONLY))
CLIP_NONE, CLIP_NORM, CLIP_VALUE = (k.value for k in (
    kernels.CLIP_NONE, kernels.CLIP_NORM, kernels.CLIP_VALUE))
NORM_KINDS = {1.0: stats.NORM_L1.value, 2.0: stats.NORM_L2.value, float("inf"): stats.NORM_INF.value}


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


class Plan:
    """The device tables of one list of tensors, and what the launches cache beside them.

    Built from :class:`RowBuilder`'s rows: the row table and the work-item table in one device
    buffer (``rows``, ``chunks``; ``host``/``host_rows`` the host copy), the launch shape, and
    per-launch facts (``codes``: the row codes present; ``param_dtypes``; ``aligned``: every
    operand address 16-byte aligned; ``ngrad``: the work items of the rows with a gradient, which
    come first). ``keepalive``: what the rows address, alive as long as the plan; ``copy_back``:
    ``(grad, conformed copy)`` pairs, a row reading the copy in the grad's place (the plan is then
    ``volatile``: its caller rebuilds it every step); ``glayout``: what :func:`patch_grads`
    checks new grads against. The launches fill ``partials``, ``flags``, ``counter`` (the
    statistics pass's buffers) and ``kernel_key`` on first use.
    """

    __slots__ = ("launch", "ntensors", "nchunks", "ngrad", "codes", "param_dtypes", "aligned", "host",
                 "host_rows", "rows", "chunks", "arrivals", "keepalive", "copy_back", "volatile",
                 "glayout", "partials", "flags", "counter", "kernel_key")

    def __init__(self, builder: RowBuilder, device: torch.device, *, keepalive: list | None = None,
                 copy_back: list | None = None, glayout: tuple | None = None) -> None:
        self.launch = launch = builder.launch()
        nchunks = [max(1, -(-n // launch.chunk)) for n in builder.numels]  # empty tensors count a step
        for row, k in zip(builder.rows, nchunks):
            row[COL_NCHUNKS] = k
        self.ngrad = sum(nchunks[: builder.grad_rows])
        self.codes, self.param_dtypes, self.aligned = builder.codes, builder.param_dtypes, builder.aligned
        self.keepalive = [] if keepalive is None else keepalive
        self.copy_back = [] if copy_back is None else copy_back
        self.volatile = bool(self.copy_back)
        self.glayout = glayout
        self.partials = self.flags = self.counter = self.kernel_key = None
        self.ntensors = ntensors = len(builder.rows)
        self.nchunks = total = sum(nchunks)
        if ntensors == 0:
            self.host = self.host_rows = self.rows = self.chunks = self.arrivals = None
            return
        counts = torch.tensor(nchunks, dtype=torch.int64)
        tensor_of = torch.repeat_interleave(torch.arange(ntensors, dtype=torch.int64), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        items = (tensor_of << 32) | (torch.arange(total, dtype=torch.int64) - first)
        self.host = torch.cat([torch.tensor(builder.rows, dtype=torch.int64).flatten(), items])
        self.host_rows = self.host[: ntensors * ROW].view(ntensors, ROW).numpy()  # writes land in host
        # a fresh device buffer per plan: a launch on the plan this one replaces may still read its own
        buf = upload(self.host, device) if device.type != "cpu" else self.host.clone()
        self.rows = buf[: ntensors * ROW]
        self.chunks = buf[ntensors * ROW :]
        self.arrivals = torch.zeros(ntensors, dtype=torch.int32, device=device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
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
        self.param_dtypes = 0
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
            self.param_dtypes |= 1 << (code % 4)
            self.grad_rows += 1

    def launch(self) -> LaunchConfig:
        masters = any(self.codes >> c & 1 for c in range(kernels.NCODES.value) if c & CODE_MASTER)
        return master_config if masters else config

    def build(self, device: torch.device, *, keepalive: list | None = None, copy_back: list | None = None,
              glayout: tuple | None = None) -> Plan:
        """The plan of the rows added so far, on ``device`` (the keyword arguments: :class:`Plan`'s)."""
        return Plan(self, device, keepalive=keepalive, copy_back=copy_back, glayout=glayout)


def patch_column(plan: Plan, col: int, values: list[int]) -> None:
    """Write ``values`` into column ``col`` of the first ``len(values)`` rows, host and device
    tables alike (new grad addresses after ``zero_grad(set_to_none=True)``): one small upload of
    those rows into the device table in place, no device allocation, no wait.

    The device write is ordered on the current stream after the launches that read the old rows,
    as any in-place update of a tensor is. It is a non-blocking copy from pageable memory, which
    CUDA stages before the call returns: the host rows can change again at once, and the call
    does not wait for the GPU to reach it (a pinned source would need an event or a fresh
    allocation per step)."""
    n = len(values)
    if n == 0:
        return
    plan.host_rows[:n, col] = values
    dst, src = plan.rows[: n * ROW], plan.host[: n * ROW]
    dst.copy_(src, non_blocking=dst.device.type != "cpu")


def grad_layouts(params: list[torch.Tensor]) -> tuple:
    """What :func:`patch_grads` checks new grads against, ``params`` in row order: which are
    contiguous, which channels_last, and the rest. One ``is_contiguous`` per grad costs half of
    comparing its stride tuple."""
    contiguous = [p.is_contiguous() for p in params]
    channels_last = [not c and p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last)
                     for p, c in zip(params, contiguous)]
    others = [(k, p) for k, (p, c, cl) in enumerate(zip(params, contiguous, channels_last))
              if not (c or cl)]
    return contiguous, channels_last if any(channels_last) else None, others


_contiguous = torch.Tensor.is_contiguous
_channels_last = functools.partial(torch.Tensor.is_contiguous, memory_format=torch.channels_last)


def patch_grads(plan: Plan, grads: list[torch.Tensor], addrs: list[int]) -> bool:
    """Point the plan's gradient rows at ``grads`` (in row order; ``addrs`` their data pointers)
    when only their addresses moved. False, nothing written, when a grad's memory order differs
    from its param's (:func:`grad_layouts`): autograd and the ``.grad`` setter pin dtype, shape
    and device, the strides are all a user-assigned grad can still change."""
    contiguous, channels_last, others = plan.glayout
    if not all(map(_contiguous, compress(grads, contiguous))):
        return False
    if channels_last is not None and not all(map(_channels_last, compress(grads, channels_last))):
        return False
    if others and not all(same_layout(grads[k], p) for k, p in others):
        return False
    if plan.aligned and any(a & 15 for a in addrs):  # the launch's cache key changes with it
        plan.aligned, plan.kernel_key = False, None
    patch_column(plan, OP_GRAD, addrs)
    return True


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


def kernel_key(plan: Plan) -> tuple:
    """The part of a launch's cache key that the plan fixes: its own buffers' alignment (made by
    the allocator: aligned, but the chunk table starts after the rows), the element-alignment
    flag and the launch shape. Passed as ``key=``, it spares the launcher keying every argument
    and constexpr on every step (a tenth of the yolov5n optimizer phase's host time). Kept on the
    plan (``plan.kernel_key``) until :func:`patch_grads` clears the alignment flag."""
    if plan.kernel_key is None:
        launch = plan.launch
        plan.kernel_key = (plan.rows.data_ptr() % 16 == 0, plan.chunks.data_ptr() % 16 == 0,
                           plan.arrivals.data_ptr() % 16 == 0, plan.aligned, launch.block, launch.unroll,
                           launch.num_warps)
    return plan.kernel_key


def launch_update(launcher: CachedLauncher, chunk_fn, plan: Plan, hp: torch.Tensor | None = None, *,
                  wide16: bool = False, grad_scale: torch.Tensor | None = None,
                  clip: torch.Tensor | None = None, clip_value: torch.Tensor | None = None,
                  found_inf: torch.Tensor | None = None, ema_w: float | torch.Tensor = 0.0,
                  width: int = 8) -> None:
    """One launch of :func:`kernels.update_kernel` over ``plan`` with the client's ``chunk_fn``
    (the contract in :func:`kernels.run`); ``wide16`` doubles the blocks of 16-bit rows. The
    unscaled grads are multiplied by ``clip`` (a clip coefficient) or clamped to
    ``[-clip_value, clip_value]`` (1-element float32 tensors on the device; at most one of them).
    ``ema_w``: the EMA weight, or a 1-element float32 tensor on the device holding it (read by
    the kernel: what a launch captured in a CUDA graph needs)."""
    if plan.nchunks == 0:
        return
    if clip is not None and clip_value is not None:
        raise ValueError("launch_update: pass clip (a coefficient) or clip_value (a bound), not both")
    mode = CLIP_NORM if clip is not None else CLIP_VALUE if clip_value is not None else CLIP_NONE
    clip = clip if clip is not None else clip_value
    dummy = plan.rows  # stands in for absent pointers; never read (the HAS_* flags are off)
    launch = plan.launch
    ema_ptr = isinstance(ema_w, torch.Tensor)
    if compat.jit_key_pending(chunk_fn):  # its cache key, callees first, before the key below hashes it
        jit_keys.settle(chunk_fn)
    key = ("update", chunk_fn, wide16, kernel_key(plan), plan.codes, _ptr_class(hp), _ptr_class(grad_scale),
           _ptr_class(clip), mode, _ptr_class(found_inf), width, ema_ptr)
    launcher(
        kernels.update_kernel, (plan.nchunks,), plan.rows, plan.chunks, dummy if hp is None else hp,
        plan.arrivals, dummy if grad_scale is None else grad_scale, dummy if clip is None else clip,
        dummy if found_inf is None else found_inf, ema_w if ema_ptr else float(ema_w),
        BLOCK=launch.block, NB=launch.unroll, CODES=plan.codes, ALIGNED=plan.aligned,
        HAS_SCALE=grad_scale is not None, HAS_CLIP=mode,
        HAS_INF=found_inf is not None, WIDTH=width, WIDE16=wide16, CHUNK_FN=chunk_fn, EMA_PTR=ema_ptr,
        num_warps=launch.num_warps, key=key,
    )


UPDATE_EMA_W_ARG = 7  # where launch_update passes ema_w among the kernel's arguments


def launch_stats(launcher: CachedLauncher, plan: Plan, out: torch.Tensor, *,
                 grad_scale: torch.Tensor | None = None, max_norm: float = 0.0,
                 norm_type: float | None = None, scale_update: tuple | None = None) -> None:
    """One launch of the gradient-statistics pass: ``out[0:3] = [norm of grad / grad_scale,
    clip coefficient for max_norm, 1.0 if any grad is inf/NaN]`` (norm_type None: the check only).

    ``scale_update``: ``(growth_tracker, growth_factor, backoff_factor, growth_interval)`` of the
    GradScaler whose float32 ``grad_scale`` this is (int32 tracker, float32-exact factors): the
    launch then also stores the scale it divided by in ``out[3]`` and updates scale and tracker
    as ``GradScaler.update()`` does. Needs a plan with gradients."""
    if plan.ngrad == 0:  # no gradient this step: norm 0, nothing to clip, nothing non-finite
        if scale_update is not None:
            raise ValueError("launch_stats: scale_update needs a plan with gradients")
        out[:3].copy_(torch.tensor([0.0, 1.0, 0.0]), non_blocking=True)
        return
    if plan.partials is None:
        device = plan.rows.device
        plan.partials = torch.empty(plan.ngrad, dtype=torch.float32, device=device)
        plan.flags = torch.empty(plan.ngrad, dtype=torch.int32, device=device)
        plan.counter = torch.tensor([0, plan.ngrad], dtype=torch.int32).to(device)
    norm = stats.NORM_NONE.value if norm_type is None else NORM_KINDS[float(norm_type)]
    launch = plan.launch
    if scale_update is None:
        tracker, growth, backoff, interval = plan.rows, 1.0, 1.0, 0
    else:
        tracker, growth, backoff, interval = scale_update
    key = ("stats", kernel_key(plan), plan.param_dtypes, _ptr_class(grad_scale), _ptr_class(out), norm,
           scale_update is not None and (_ptr_class(tracker), interval == 1, interval % 16 == 0,
                                          interval < 2**31))
    launcher(
        stats.grad_stats_kernel, (plan.ngrad,), plan.rows, plan.chunks,
        plan.rows if grad_scale is None else grad_scale, plan.partials, plan.flags, plan.counter,
        out, float(max_norm), tracker, float(growth), float(backoff), int(interval),
        BLOCK=launch.block, NB=launch.unroll, PARAM_DTYPES=plan.param_dtypes, ALIGNED=plan.aligned,
        HAS_SCALE=grad_scale is not None, NORM=norm, UPDATE_SCALE=scale_update is not None,
        num_warps=launch.num_warps, key=key,
    )


class TensorListPlans:
    """Plans for lists of tensors that are not an optimizer's params (clipping, FusedEMA), keyed by
    the tensors' addresses, sizes and dtypes, so a list seen again reuses its tables."""

    def __init__(self, size: int = 8) -> None:
        self._plans: dict[tuple, Plan] = {}
        self._size = size
        self.launcher = CachedLauncher()

    def lookup(self, key: tuple) -> Plan | None:
        return self._plans.get(key)

    def get(self, key: tuple, build) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self._size:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = build()
        return plan


__all__ = ["DTYPE_CODES", "UPDATE_EMA_W_ARG", "LaunchConfig", "Plan", "RowBuilder", "TensorListPlans",
           "code_of", "config", "conform", "grad_layouts", "is_dense", "kernel_key", "launch_stats",
           "launch_update", "master_config", "patch_grads", "same_layout", "upload"]
