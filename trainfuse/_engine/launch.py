"""Kernel launch with the host work cut to the bone.

Triton's ``kernel[grid](...)`` binds and specializes every argument and hashes a cache key on each
call: tens of microseconds, as much as a whole 10M-param optimizer update takes on the GPU. Our
launches repeat the same specialization every step (the same constexprs, device-allocated 16-byte
aligned buffers), so after Triton has compiled and launched one the normal way we keep its compiled
kernel and call its launcher directly. Any surprise (launch hooks set, the interpreter, an API this
Triton lacks) takes the normal path.

Beside it, what every one-launch reduction needs: :func:`stream_workspace`, the per-stream
partials and arrival counters (the losses' sums, FusedMLP's split-K weight grads), and
:func:`sm_count` for persistent grids.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch


def _hooked(hook) -> bool:
    # triton >= 3.5 keeps launch hooks in a HookChain that is never None: look inside it
    return hook is not None and getattr(hook, "calls", True) != []


def _arg_key(a) -> tuple | type:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31
    return float


class Compiled:
    """A compiled kernel and its trailing constexpr values, launched straight through Triton's
    launcher: ``compiled(grid, stream, *args)`` with a 1-d grid size and a raw stream handle. The
    one place that knows the launcher's calling convention."""

    __slots__ = ("run", "function", "meta", "consts")

    def __init__(self, kernel, consts: list) -> None:
        self.run, self.function, self.meta = kernel.run, kernel.function, kernel.packed_metadata
        self.consts = consts

    def __call__(self, grid: int, stream: int, *args) -> None:
        self.run(grid, 1, 1, stream, self.function, self.meta, None, None, None, *args, *self.consts)


class CachedLauncher:
    """``launcher(fn, grid, *args, num_warps=..., **constexprs)``: ``args`` are tensors, Python
    floats (never specialized by Triton, so any value reuses a kernel) and Python ints (keyed on
    what Triton specializes them on: equal to 1, divisible by 16, 32- or 64-bit).

    A caller that already knows what its arguments specialize on may pass ``key=`` (any hashable
    that changes whenever the compiled kernel would: dtypes, pointer alignment, the ints' classes,
    the constexprs) and skip the per-argument keying; ``stream=`` (a raw CUDA stream handle)
    launches on that stream instead of the current one."""

    def __init__(self) -> None:
        self._kernels: dict[tuple, Any] = {}
        self._usable = True

    def __call__(self, fn, grid: tuple[int], *args: torch.Tensor | float, num_warps: int,
                 key: Any = None, stream: int | None = None, **constexprs) -> None:
        device = args[0].device
        if not self._usable or device.type != "cuda":
            fn[grid](*args, num_warps=num_warps, **constexprs)
            return
        import triton

        hooks = triton.knobs.runtime
        if key is None:
            # what Triton specializes pointer arguments on: element type and 16-byte alignment
            # (a float64 grad_scale must not reuse the kernel compiled for GradScaler's float32)
            key = (fn, device.index, num_warps, *map(_arg_key, args), *constexprs.items())
        else:
            key = (fn, device.index, key)
        kernel = self._kernels.get(key)
        if kernel is None or _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            if stream is not None and stream != torch._C._cuda_getCurrentRawStream(device.index):
                with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                    kernel = fn[grid](*args, num_warps=num_warps, **constexprs)
            else:
                kernel = fn[grid](*args, num_warps=num_warps, **constexprs)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
                self._kernels[key] = Compiled(kernel, [constexprs[n] for n in fn.arg_names[len(args):]])
            else:
                self._usable = False
            return
        if stream is None:
            stream = torch._C._cuda_getCurrentRawStream(device.index)
        kernel(grid[0], stream, *args)

    def direct(self) -> bool:
        """Whether a caller may launch kernels it got from :meth:`compiled` itself, straight
        through their launchers (no launch hooks set, the cache in use): checked once per batch
        of such launches."""
        import triton

        hooks = triton.knobs.runtime
        return self._usable and not (_hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook))

    def compiled(self, fn, device_index: int, key: Any) -> Compiled | None:
        """The kernel that an earlier call with ``key=key`` compiled, or None: for callers that
        launch the same kernel many times with the arguments already resolved."""
        return self._kernels.get((fn, device_index, key))


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (persistent grids, split-K choices)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


_workspaces: dict[tuple, list[torch.Tensor]] = {}


def stream_workspace(device: torch.device, stream: int | None, dtype: torch.dtype, floats: int,
                     counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for one-launch reductions (a loss's partial sums, a split-K matmul's partial
    tiles) on one stream: ``floats`` elements of ``dtype`` and ``counters`` int32 arrival counters
    at zero. One set per (device, stream, dtype), kept across calls: kernels on a stream run in
    order and the program that arrives last re-arms its counter, so a call allocates nothing.
    ``stream`` is a raw CUDA stream handle (None: the current one); a new or grown set is made on
    that stream, so the counters' zero fill is ordered before their first use."""
    if device.type == "cuda" and stream is None:
        stream = torch._C._cuda_getCurrentRawStream(device.index)
    key = (device, stream, dtype)
    ws = _workspaces.get(key)
    if ws is None or ws[0].numel() < floats or ws[1].numel() < counters:
        have_f, have_c = (0, 0) if ws is None else (ws[0].numel(), ws[1].numel())
        ctx = (torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)) if device.type == "cuda"
               else contextlib.nullcontext())
        with ctx:
            scratch = ws[0] if ws is not None and have_f >= floats else torch.empty(
                max(floats, 2 * have_f, 1024), dtype=dtype, device=device)
            count = ws[1] if ws is not None and have_c >= counters else torch.zeros(
                max(counters, have_c), dtype=torch.int32, device=device)
        ws = _workspaces[key] = [scratch, count]
    return ws[0], ws[1]


def stream_workspace_fits(device: torch.device, stream: int, dtype: torch.dtype, floats: int,
                          counters: int) -> bool:
    """Whether :func:`stream_workspace` would return its kept set as it is (no allocation)."""
    ws = _workspaces.get((device, stream, dtype))
    return ws is not None and ws[0].numel() >= floats and ws[1].numel() >= counters


__all__ = ["CachedLauncher", "sm_count", "stream_workspace", "stream_workspace_fits"]
