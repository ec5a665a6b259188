"""What captured steps and graphed modules share: the side stream they capture on, and the eager
first call watched for host synchronizations (a call that syncs must never be captured)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from trainfuse._runtime import compat

# what torch's sync debug mode warns on a host synchronization, and what it warns once about itself
_SYNC_WARNING = "called a synchronizing CUDA operation"
_PROTOTYPE_WARNING = "Synchronization debug mode is a prototype feature"

# held by a thread that synchronizes with the GPU in the background (a checkpoint's copies to the
# host) while it does, and by watching_syncs around the call it watches: torch's sync debug mode
# and the warnings it raises are the process's, not the thread's, so a background sync during the
# watched call would be taken for the call's own and keep its step out of CUDA graphs for good
background_syncs = threading.Lock()

# one side stream per device for first sightings and captures, shared by every captured step and
# graphed module: graphs reuse memory best when captured on the same stream
_side_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream first sightings and captures run on, on ``device`` (one per device)."""
    stream = _side_streams.get(device.index)
    if stream is None:
        stream = _side_streams[device.index] = torch.cuda.Stream(device)
    return stream


def on_side_stream(device: torch.device, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` eagerly on the side stream, ordered after and before the current stream."""
    side, current = side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = fn(*args, **kwargs)
    current.wait_stream(side)
    return out


def watching_syncs(device: torch.device, fn: Callable[..., Any], /, *args: Any,
                   **kwargs: Any) -> tuple[Any, str | None]:
    """``fn(*args, **kwargs)`` on the side stream under torch's sync debug mode: its result, and
    the first host synchronization it made with the Python file and line that made it (None if
    none). Only this thread's synchronizations count: torch's debug mode is the process's, and
    another thread's (ultralytics plots its first batches in threads, a checkpoint thread copies
    to the host) would otherwise keep ``fn`` out of CUDA graphs for good. Other warnings are
    passed on."""
    with background_syncs:
        return _watching_syncs(device, fn, *args, **kwargs)


def _watching_syncs(device: torch.device, fn: Callable[..., Any], /, *args: Any,
                    **kwargs: Any) -> tuple[Any, str | None]:
    previous = torch.cuda.get_sync_debug_mode()
    me = threading.get_ident()
    caught: list[tuple[int, Any, type, str, int]] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        caught.append((threading.get_ident(), message, category, filename, lineno))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # called in the thread that warns; put back on exit
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = on_side_stream(device, fn, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sync = None
    for thread, message, category, filename, lineno in caught:
        text = str(message)
        if _SYNC_WARNING in text:
            if thread == me:
                sync = sync or f"{text.strip().splitlines()[0]} (from {filename}:{lineno})"
        elif _PROTOTYPE_WARNING not in text:  # torch's note on the debug mode itself: ours to drop
            warnings.warn_explicit(message, category, filename, lineno)
    return out, sync


def captured(pool: Any, fn: Callable[..., Any], /, *args: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn(*args)`` captured on the current stream into a new graph that allocates from ``pool``:
    the graph and what ``fn`` returned. Whatever fails, the stream leaves capture mode and the
    allocator stops serving ``pool`` before the error propagates: a capture that CUDA invalidated
    fails in ``capture_end`` before torch ends the pool's allocation, which would leave every later
    allocation on this stream (and every capture into ``pool``) broken."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: a pinned-memory or other thread of the process stays free to call CUDA
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        out = fn(*args)
    except BaseException as e:
        try:
            _end(graph, pool)
        except BaseException as ending:  # the capture was invalidated by what fn did: fn's error says why
            e.add_note(f"(ending the capture then failed too: {ending})")
        raise
    _end(graph, pool)
    return graph, out


def _end(graph: torch.cuda.CUDAGraph, pool: Any) -> None:
    try:
        graph.capture_end()
    except BaseException:
        try:
            compat.end_allocate_to_pool(torch.cuda.current_device(), pool)
        except RuntimeError:  # already ended
            pass
        raise


__all__ = ["background_syncs", "captured", "on_side_stream", "side_stream", "watching_syncs"]
