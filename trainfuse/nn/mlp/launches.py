"""Launching FusedMLP's kernels with as little host time as a small MLP's step needs.

:func:`matmul` keys a launch on its signature, plans it once (:func:`trainfuse.nn.mlp.tiles.make_plan`)
and launches the compiled kernel directly. A chain (one :class:`trainfuse.nn.mlp.function.FusedMLPFunction`
pass) goes further: after its first call it launches from sites bound to its signature
(:class:`LaunchSite`, one per layer and direction, gathered in :class:`ChainSites`), which key
nothing, and those record their launches instead of making them where the pass ends by replaying
the list as one CUDA graph (:func:`trainfuse._runtime.launch.finish_recording`). Equal lists are
equal launches, so nothing but the host time changes.

:data:`config` holds the launch settings (documented to users as ``trainfuse.nn.mlp.config``:
``config.graphs = False`` turns graph replay off). Everything here reads it as this module's
global at call time, so a test or benchmark may also swap the object for another.
"""

from __future__ import annotations

import math

import torch

from trainfuse._runtime.backend import interpreting
from trainfuse._runtime.launch import (
    CachedLauncher,
    Compiled,
    Replays,
    ensure_allocator,
    interrupt_recording,
    recording,
    start_recording,
    stream_workspace,
    stream_workspace_fits,
)
from trainfuse.nn.mlp.activations import DERIV_SAVED, Layer
from trainfuse.nn.mlp.kernels import (
    EPI_ACT_GRAD,
    EPI_FORWARD,
    EPI_PLAIN,
    EPI_WGRAD,
    act_grad_kernel,
    mask_kernel,
    mm_kernel,
)
from trainfuse.nn.mlp.tiles import MatmulConfig, MatmulConfigs, MatmulPlan, make_plan

launcher = CachedLauncher()
config = MatmulConfigs()

_plans: dict[tuple, MatmulPlan] = {}  # launch plans by call signature
_MAX_PLANS = 4096  # plans and chain signatures kept before starting over (e.g. a new batch size every call)


def _drop_scale(p: float) -> float:
    """What dropout multiplies the kept elements by (the call's own ``p``: it is not part of the
    cached plan, so a changed ``Dropout.p`` takes effect at once)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


class LaunchSite:
    """One launch site of a chain (a layer's forward, weight grad or input grad) under one chain
    signature (:func:`chain_key`): once its plan and compiled kernel are known, later calls
    launch it straight through the kernel's launcher, with no per-launch keying. The chain
    signature fixes everything the launch's own key would hold (shapes, strides, dtypes,
    alignment, epilogue); only the tensors' addresses, the seed and ``p`` change call to call."""

    __slots__ = ("run", "grid", "ints", "split", "ws_floats", "tiles")

    def __init__(self) -> None:
        self.run = None

    def bind(self, compiled: Compiled, plan: MatmulPlan) -> None:
        self.grid, self.ints = plan.grid[0], plan.ints
        self.split, self.ws_floats, self.tiles = plan.split, plan.ws_floats, plan.tiles
        self.run = compiled

    def bind_elementwise(self, compiled: Compiled, grid: int) -> None:
        """An elementwise kernel's site (:func:`act_grad`): only the kernel and its grid."""
        self.grid, self.ints, self.split = grid, (), 1
        self.run = compiled

    def launch(self, stream: int, a, b, c, bias, x, seed: int, p: float) -> None:
        """The bound launch on ``stream`` with the operands of :func:`matmul` (``bias`` and ``x``
        resolved as there). Only their addresses are read, so a caller may pass the tensors a
        transposed view was taken of and skip making the view. The launcher gets the addresses
        as ints: given a tensor it calls its ``data_ptr`` and asks the driver about the address,
        per pointer argument (H200 host: 12.5 against 11.3 us a launch)."""
        a_ = a.data_ptr()
        rec = recording.launches
        if self.split > 1:
            if rec is not None and not stream_workspace_fits(a.device, stream, torch.float32, self.ws_floats,
                                                             self.tiles):
                interrupt_recording()  # a new workspace: its zero fill must not pass the recorded
                rec = None
            ws, cnt = stream_workspace(a.device, stream, torch.float32, self.ws_floats, self.tiles)
            ws, cnt = ws.data_ptr(), cnt.data_ptr()
        else:
            ws = cnt = a_
        bias_, x_ = bias.data_ptr(), x.data_ptr()
        args = (a_, b.data_ptr(), c.data_ptr(), bias_, x_, x_, bias_, ws, cnt, *self.ints, seed, float(p),
                _drop_scale(p))
        if rec is not None:
            rec.append((self.run, self.grid, args))
        else:
            self.run(self.grid, stream, *args)


class ChainSites(list):
    """A chain pass's launch sites (a list of :class:`LaunchSite`) and the CUDA graphs its recorded
    launches replay as (``replays``, see :func:`trainfuse._runtime.launch.finish_recording`)."""

    __slots__ = ("replays",)

    def __init__(self, sites: int) -> None:
        super().__init__(LaunchSite() for _ in range(sites))
        self.replays = Replays()


_chains: dict[tuple, ChainSites] = {}  # by chain signature (:func:`chain_key`)


def chain_sites(key: tuple, sites: int) -> ChainSites:
    """The launch sites of the chain pass with signature ``key`` (``sites`` of them, made unbound
    on first use)."""
    chain = _chains.get(key)
    if chain is None:
        if len(_chains) >= _MAX_PLANS:
            _chains.clear()
        chain = _chains[key] = ChainSites(sites)
    return chain


def chain_key(x: torch.Tensor, weights, biases, layers: list[Layer], cd: torch.dtype, grads: bool) -> tuple:
    """What fixes every launch of a chain's forward (and, with the grad's layout, its backward):
    the input's and parameters' shapes, strides, dtypes and 16-byte alignment, the layers'
    activations and whether they drop, the compute dtype and the launch shapes. The tensors the
    chain makes itself (outputs, grads) are contiguous and aligned, so theirs follow from these."""
    key = [config.serial, cd, grads, x.device, x.shape, x.stride(), x.dtype, x.data_ptr() % 16,
           torch.backends.cuda.matmul.allow_tf32]
    for layer, w, b in zip(layers, weights, biases):
        key += (layer.act, layer.p > 0.0, layer.recompute, w.shape, w.stride(), w.dtype, w.data_ptr() % 16,
                None if b is None else (b.dtype, b.data_ptr() % 16))
    return tuple(key)


def start_chain_recording(stream: int, layers: list[Layer]) -> None:
    """Record a chain pass's launches for graph replay, unless ``config.graphs`` is off or a layer
    drops (a fresh seed each call: its launches never repeat)."""
    if config.graphs and not any(layer.p > 0.0 for layer in layers):
        start_recording(stream)


def matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cd: torch.dtype, epi: int, *,
           act: int = 0, bias: torch.Tensor | None = None, bias_rows: bool = False,
           aux: torch.Tensor | None = None, pre: torch.Tensor | None = None, db: torch.Tensor | None = None,
           seed: int = 0, p: float = 0.0, drop_index: tuple[int, int] | None = None,
           accumulate: bool = False, stream: int | None = None, slot: LaunchSite | None = None) -> None:
    """``c = epilogue(a @ b)`` for 2-d views ``a`` (M, K), ``b`` (K, N), ``c``, ``aux``, ``pre``
    (M, N) with any strides. See :func:`trainfuse.nn.mlp.kernels.mm_kernel` for the epilogues;
    ``drop_index`` is ``(d_m, d_n)``, by default ``(N, 1)``; ``accumulate`` (``EPI_WGRAD``): add to
    what ``c`` and ``db`` hold; ``stream`` a raw CUDA stream (default: the current).

    The launch plan is cached on the call's signature, and the compiled kernel is launched
    directly: a training step repeats the same calls, and the host time per launch is what a
    small MLP's step is made of. A ``slot`` (a chain's :class:`LaunchSite`, whose
    chain signature already fixes this call's) skips even the keying once bound; its caller
    passes ``stream`` and has set Triton's allocator (:func:`trainfuse._runtime.launch.ensure_allocator`)."""
    x = aux if aux is not None else pre if pre is not None else c
    if pre is not None and act not in DERIV_SAVED:
        raise ValueError("matmul: pre (the activation's derivative) is stored for GELU and SiLU only")
    has_bias = bias is not None or db is not None
    bias_t = bias if bias is not None else db if db is not None else c
    if slot is not None and slot.run is not None:
        slot.launch(stream, a, b, c, bias_t, x, seed, p)
        return
    if recording.launches is not None:
        interrupt_recording()
    drop = p > 0.0
    if accumulate and epi != EPI_WGRAD:
        raise ValueError("matmul: accumulate is for the weight grad epilogue only")
    key = (config.serial, epi, act, cd, bias_rows, drop, drop_index, pre is None, accumulate, a.device,
           a.shape, b.shape, a.stride(), b.stride(), c.stride(), x.stride(),
           a.dtype, b.dtype, c.dtype, x.dtype, has_bias and bias_t.dtype,
           a.data_ptr() % 16, b.data_ptr() % 16, c.data_ptr() % 16, x.data_ptr() % 16,
           bias_t.data_ptr() % 16, torch.backends.cuda.matmul.allow_tf32 if cd == torch.float32 else None)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:  # e.g. a new batch size every call: start over
            _plans.clear()
        plan = _plans[key] = make_plan(config, a, b, c, x, cd, epi, act, has_bias, bias_rows, pre is not None,
                                        drop, drop_index, accumulate)
    if plan.constexprs["TMA"]:
        ensure_allocator()
    if plan.split > 1:  # split-K partials and per-tile arrival counters of this stream
        ws, cnt = stream_workspace(a.device, stream, torch.float32, plan.ws_floats, plan.tiles)
    else:
        ws = cnt = a
    launcher(mm_kernel, plan.grid, a, b, c, bias_t, x, x, bias_t, ws, cnt, *plan.ints, seed, float(p),
             _drop_scale(p), num_warps=plan.warps, key=key, stream=stream, **plan.constexprs)
    if slot is not None:
        compiled = launcher.compiled(mm_kernel, a.device.index, key)
        if compiled is not None:
            slot.bind(compiled, plan)


def _weight_first(w: torch.Tensor, cd: torch.dtype) -> bool:
    if config.weight_first is None:
        return cd != torch.float32
    return config.weight_first


def linear_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
                   pre: torch.Tensor | None, cd: torch.dtype, act: int, seed: int, p: float,
                   stream: int | None = None, slot: LaunchSite | None = None) -> None:
    """``out = dropout(f(x W^T + b))`` (and ``pre = f'(x W^T + b)``, GELU and SiLU only); with
    ``config.weight_first`` as ``out^T = W x^T``, so that the weight is the matmul's A operand."""
    first = _weight_first(w, cd)
    if slot is not None and slot.run is not None:
        slot.launch(stream, w if first else x, x if first else w, out, out if b is None else b,
                    out if pre is None else pre, seed, p)
    elif first:
        matmul(w, x.t(), out.t(), cd, EPI_FORWARD, act=act, bias=b, bias_rows=True,
               pre=None if pre is None else pre.t(), seed=seed, p=p, drop_index=(1, out.shape[1]),
               stream=stream, slot=slot)
    else:
        matmul(x, w.t(), out, cd, EPI_FORWARD, act=act, bias=b, pre=pre, seed=seed, p=p, stream=stream,
               slot=slot)


def linear_dgrad(dpre: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cd: torch.dtype, act: int,
                 saved: torch.Tensor | None, seed: int, p: float, stream: int | None = None,
                 slot: LaunchSite | None = None) -> None:
    """``out = (dpre W) * f'(saved) * keep / (1 - p)`` (the previous layer's activation and dropout
    grads; plain ``dpre W`` when there are none); ``config.weight_first`` as for the forward."""
    epi = EPI_ACT_GRAD if act or p > 0.0 else EPI_PLAIN
    first = _weight_first(w, cd)
    if slot is not None and slot.run is not None:
        slot.launch(stream, w if first else dpre, dpre if first else w, out, out,
                    out if saved is None else saved, seed, p)
    elif first:
        matmul(w.t(), dpre.t(), out.t(), cd, epi, act=act, aux=None if saved is None else saved.t(),
               seed=seed, p=p, drop_index=(1, out.shape[1]), stream=stream, slot=slot)
    else:
        matmul(dpre, w, out, cd, epi, act=act, aux=saved, seed=seed, p=p, stream=stream, slot=slot)


def act_grad(g: torch.Tensor, saved: torch.Tensor, out: torch.Tensor, act: int, seed: int, p: float,
             stream: int | None = None, slot: LaunchSite | None = None) -> None:
    """``out = g * f'(saved)`` (and the dropout mask), elementwise over row-major tensors. A
    ``slot`` (a chain's launch site, see :func:`matmul`) launches straight through the compiled
    kernel once bound: keying the launch took 45 us of host time on the H200 machines."""
    n = g.numel()
    if slot is not None and slot.run is not None:
        args = (g.data_ptr(), saved.data_ptr(), out.data_ptr(), n, seed, float(p), _drop_scale(p))
        rec = recording.launches
        if rec is not None:
            rec.append((slot.run, slot.grid, args))
        else:
            slot.run(slot.grid, stream, *args)
        return
    if recording.launches is not None:
        interrupt_recording()
    block = config.act_block
    grid = max(1, -(-n // block))
    rne = interpreting() and out.dtype == torch.bfloat16
    # what the compiled kernel depends on: Triton specializes n on == 1, % 16 and 32-bit (not seed)
    key = ("act_grad", config.serial, act, p > 0.0, rne, block, g.device, g.dtype, saved.dtype, out.dtype,
           g.data_ptr() % 16, saved.data_ptr() % 16, out.data_ptr() % 16, n == 1, n % 16 == 0, n < 2**31)
    launcher(act_grad_kernel, (grid,), g, saved, out, n, seed, float(p), _drop_scale(p), ACT=act,
             DROP=p > 0.0, RNE=rne, BLOCK=block, num_warps=4, key=key, stream=stream)
    if slot is not None and g.device.type == "cuda":
        compiled = launcher.compiled(act_grad_kernel, g.device.index, key)
        if compiled is not None:
            slot.bind_elementwise(compiled, grid)


def dropout_mask(seed: int, shape: tuple[int, int], p: float, device: torch.device | str) -> torch.Tensor:
    """The keep mask (bool, ``shape``) that a layer's dropout draws from ``seed``: what the
    forward applies (and the backward reads back or, with no activation, draws again). For tests
    and debugging."""
    n = math.prod(shape)
    out = torch.empty(shape, dtype=torch.int8, device=device)
    if n:
        mask_kernel[(-(-n // 1024),)](out, n, seed, float(p), BLOCK=1024)
    return out.bool()


__all__ = ["ChainSites", "LaunchSite", "MatmulConfig", "MatmulConfigs", "act_grad", "chain_key",
           "chain_sites", "config", "dropout_mask", "launcher", "linear_dgrad", "linear_forward", "matmul",
           "start_chain_recording"]
