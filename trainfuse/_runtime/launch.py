"""Kernel launch with the host work cut to the bone.

Triton's ``kernel[grid](...)`` binds and specializes every argument and hashes a cache key on each
call: tens of microseconds, as much as a whole 10M-param optimizer update takes on the GPU. Our
launches repeat the same specialization every step (the same constexprs, device-allocated 16-byte
aligned buffers), so after Triton has compiled and launched one the normal way we keep its compiled
kernel and call its launcher directly. Any surprise (launch hooks set, the interpreter, an API this
Triton lacks) takes the normal path.

Beside it, what every one-launch reduction needs: :func:`stream_workspace`, the per-stream
partials and arrival counters (the losses' sums, FusedMLP's split-K weight grads), and
:func:`sm_count` for persistent grids; the scratch memory Triton's in-kernel tensor descriptors
need (:func:`ensure_allocator`); and CUDA-graph replay of a pass of direct launches that repeats
itself (:func:`start_recording` ... :func:`finish_recording`), which takes a small MLP's step off
the host.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any

import torch

from trainfuse._runtime import compat, jit_keys, precompile
from trainfuse._runtime.backend import interpreting

_NOTHING = contextlib.nullcontext()


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


_dry: list[dict] | None = None  # the entries of launches inside dry_launches(), else None


@contextlib.contextmanager
def dry_launches():
    """Inside the block, launches through :class:`CachedLauncher` run nothing: the manifest entry
    of each (:func:`trainfuse._runtime.precompile.entry`) goes into the list yielded, each once. For
    listing the specializations a step would compile without running it, on the meta device too
    (shapes, strides and offsets, no data); not thread-safe."""
    global _dry
    outer, _dry = _dry, []
    try:
        yield _dry
    finally:
        _dry = outer


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
        # (compiled kernel, args) of the latest launch where it went through a cached kernel, else
        # None: a caller that repeats that exact launch many times may keep it (DirectStep)
        self.last: tuple[Compiled, tuple] | None = None

    def __call__(self, fn, grid: tuple[int], *args: torch.Tensor | float, num_warps: int,
                 key: Any = None, stream: int | None = None, **constexprs) -> None:
        device = args[0].device
        self.last = None
        if _dry is not None:
            entry = precompile.entry(fn, args, num_warps, constexprs)
            if entry is not None and entry not in _dry:
                _dry.append(entry)
            return
        if compat.jit_key_pending(fn):  # before anything hashes it (the key below); a caller that
            jit_keys.settle(fn, *constexprs.values())  # keys on a JIT constexpr settles it itself
        if not self._usable or device.type != "cuda" or len(grid) != 1:
            # the cached launch takes a 1-d grid: a grid of more axes goes through Triton each time
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
            # a worker may be compiling it: wait rather than compile it twice
            first = precompile.first_launch(fn, args, num_warps, constexprs) if kernel is None else _NOTHING
            with first:
                if stream is not None and stream != compat.current_raw_stream(device.index):
                    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                        kernel = fn[grid](*args, num_warps=num_warps, **constexprs)
                else:
                    kernel = fn[grid](*args, num_warps=num_warps, **constexprs)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
                consts = [constexprs[n] for n in fn.arg_names[len(args):]]
                self._kernels[key] = compiled = Compiled(kernel, consts)
                if not _hooked(hooks.launch_enter_hook) and not _hooked(hooks.launch_exit_hook):
                    self.last = compiled, args
            else:
                self._usable = False
            return
        if stream is None:
            stream = compat.current_raw_stream(device.index)
        kernel(grid[0], stream, *args)
        self.last = kernel, args

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


class DirectLaunch:
    """A launch :class:`CachedLauncher` just made through a cached kernel (its ``last``), to make
    again with the same arguments: every tensor but those in ``keep`` (compared by identity) as its
    raw address, so whoever keeps this must keep those tensors alive and where they are; the
    argument at position ``var``, if given, is replaced by each call's ``value`` (a float)."""

    __slots__ = ("kernel", "grid", "args", "index", "var")

    def __init__(self, last: tuple[Compiled, tuple], grid: int, index: int, var: int | None = None,
                 keep: tuple = ()) -> None:
        self.kernel, self.grid, self.index, self.var = last[0], grid, index, var
        self.args = [a.data_ptr() if isinstance(a, torch.Tensor) and not any(a is k for k in keep) else a
                     for a in last[1]]

    def __call__(self, value: float = 0.0) -> None:
        """Launch on the current stream of the kernel's device."""
        args = self.args
        if self.var is not None:
            args[self.var] = value
        self.kernel(self.grid, compat.current_raw_stream(self.index), *args)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` as plain integer math: Triton's is a constexpr function, about 1.6 us a
    call on the host, which a launch's grid and tile counts would pay a dozen times."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` as plain integer math (0 for 0), for the same reason."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


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
        stream = compat.current_raw_stream(device.index)
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


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the tensor descriptors a launch writes (one slice per program): the
    scratch of the stream the kernel runs on, kept across launches. Kernels on one stream run in
    order, so they can share it; a kernel on another stream (FusedMLP's side-stream weight grads)
    has its own. A fresh ``torch.empty`` here would be freed, on the current stream, as soon as the
    launch returns: the main stream's next launch could then be handed the memory a side-stream
    kernel is still writing its descriptors to (under CUDA-graph replay, where the two run at
    once, that garbles both descriptors and the graph hangs). While a graph is captured: the
    scratch of the stream it will replay on, kept with the graph."""
    capture = recording.capture
    if capture is not None:
        stream = capture[0]
    key = (compat.current_device_index(), stream)  # the default stream is handle 0 on every device
    ws = _descriptor_scratch.get(key)
    if ws is None or ws.numel() < size:
        ws, _ = stream_workspace(torch.device("cuda", key[0]), stream, torch.int8, size, 0)
        _descriptor_scratch[key] = ws
    if capture is not None:
        capture[1].append(ws)  # the graph keeps the address: keep the memory with the graph
    return ws


# the scratch per (device, stream), as stream_workspace last returned it: one lookup a launch
_descriptor_scratch: dict[tuple[int, int], torch.Tensor] = {}


def ensure_allocator() -> None:
    """Tensor descriptors made in a kernel need scratch memory from Triton's allocator, which is
    per thread (autograd runs CUDA backwards on threads of its own): set ours where none is."""
    if compat.triton_allocator_is_null():
        import triton

        triton.set_allocator(_scratch if not interpreting() else
                             lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))


# ---- CUDA-graph replay of recorded launches -------------------------------------------------------
class _Recording(threading.local):
    """Per thread (autograd runs CUDA backwards on threads of its own): the direct launches of the
    pass being recorded, the stream they go to, and while a graph is captured, the stream it will
    replay on and the scratch tensors it writes. A caller with a :class:`Compiled` kernel and its
    arguments appends ``(compiled, grid, args)`` to ``recording.launches`` where that is not None,
    instead of launching."""

    launches: list | None = None
    stream: int | None = None
    capture: tuple[int, list] | None = None


recording = _Recording()


class Replays:
    """One launch site's CUDA graphs by launch list (None: its capture failed), and the lists it
    has seen once (:func:`finish_recording`)."""

    __slots__ = ("graphs", "seen")
    MAX_GRAPHS = 4  # the caching allocator usually hands back one or two address sets
    MAX_SEEN = 8

    def __init__(self) -> None:
        self.graphs: dict[tuple, tuple | None] = {}
        self.seen: dict[tuple, None] = {}


def start_recording(stream: int) -> None:
    """Record instead of launch until :func:`finish_recording`: a pass about to launch on
    ``stream``. Not inside a capture of the caller's own (the launches go into that graph)."""
    if not torch.cuda.is_current_stream_capturing():
        recording.launches, recording.stream = [], stream


def drop_recording() -> None:
    """Forget what was recorded (the pass raised before it was finished)."""
    recording.launches = None


def interrupt_recording() -> None:
    """Launch what was recorded, now, and record no further this pass: about to enqueue work
    that is not a recorded launch (a first call's keyed launch, a workspace's zero fill), which
    must not overtake the launches recorded before it."""
    launches, recording.launches = recording.launches, None
    if launches:
        stream = recording.stream
        for run, grid, args in launches:
            run(grid, stream, *args)


def finish_recording(replays: Replays, device: torch.device) -> None:
    """The end of a recorded pass: its launches as one CUDA graph replay where this exact list
    (stream, kernels, grids, every address and scalar) was captured before, captured now where it
    was seen before, else launched one by one. Equal lists are equal launches, so a replay does
    what the launches would; it saves their host time (H200 host: 9-14 us each, a replay ~6)."""
    launches, recording.launches = recording.launches, None
    if not launches:
        return
    stream = recording.stream
    graphs, seen = replays.graphs, replays.seen
    # the stream too: a graph writes the descriptor scratch of the stream it was captured for
    lkey = (stream, *launches)
    entry = graphs.get(lkey)
    if entry is None and lkey in seen and len(graphs) < Replays.MAX_GRAPHS:
        del seen[lkey]
        # None where capture failed: this list is launched one by one from now on
        entry = graphs[lkey] = _capture(launches, stream, device)
    if entry is not None:
        entry[0].replay()  # on the current stream, which is ``stream``
        return
    if lkey not in graphs:
        seen[lkey] = None
        if len(seen) > Replays.MAX_SEEN:
            del seen[next(iter(seen))]
    for run, grid, args in launches:
        run(grid, stream, *args)


_capture_streams: dict[int, torch.cuda.Stream] = {}


def _capture(launches: list, stream: int, device: torch.device) -> tuple | None:
    """``launches`` captured into a CUDA graph (on a side stream: capture cannot use the default
    one), with the descriptor scratch of ``stream``, where it will replay; the graph holds that
    scratch. None where capture fails."""
    cap = _capture_streams.get(device.index)
    if cap is None:
        cap = _capture_streams[device.index] = torch.cuda.Stream(device)
    graph, scratch = torch.cuda.CUDAGraph(), []
    recording.capture = (stream, scratch)
    try:
        with torch.cuda.stream(cap):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for run, grid, args in launches:
                    run(grid, cap.cuda_stream, *args)
            finally:
                graph.capture_end()
    except RuntimeError as e:
        warnings.warn(f"trainfuse: a pass of launches could not be captured in a CUDA graph, so they are "
                      f"launched one by one ({str(e).splitlines()[0]})", RuntimeWarning, stacklevel=3)
        return None
    finally:
        recording.capture = None
    return graph, scratch


def stream_workspace_fits(device: torch.device, stream: int, dtype: torch.dtype, floats: int,
                          counters: int) -> bool:
    """Whether :func:`stream_workspace` would return its kept set as it is (no allocation)."""
    ws = _workspaces.get((device, stream, dtype))
    return ws is not None and ws[0].numel() >= floats and ws[1].numel() >= counters


__all__ = ["CachedLauncher", "Compiled", "DirectLaunch", "Replays", "cdiv", "drop_recording", "dry_launches",
           "ensure_allocator", "finish_recording", "interrupt_recording", "next_power_of_2", "recording",
           "sm_count", "start_recording", "stream_workspace", "stream_workspace_fits"]
