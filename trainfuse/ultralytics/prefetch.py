"""The training loader's batches copied to the GPU one batch ahead, on a stream of their own.

ultralytics' ``preprocess_batch`` copies each batch to the GPU when its iteration starts: about
20 MB of uint8 images at batch 16 and 640 px, plus the labels in four more copies, on the stream
the forward then waits on. A step replayed from CUDA graphs takes about 10 ms of GPU time on
yolov5n, and those copies add 0.4-0.5 ms to it. :class:`DevicePrefetcher` wraps the loader: when
the loop takes batch k, the copies of batch k+1 are launched on a side stream, and run while
batch k trains; batch k+1 then reaches the loop already on the GPU (``preprocess_batch``'s own
``.to(device)`` finds nothing to do). The loop's stream waits for the copies' event before using
a batch, and each copied tensor is marked as used there (``record_stream``), so its memory is not
reused before that stream is done with it. Batches come from pinned memory (ultralytics' loaders
pin), so the copies do not block the host.

A ``finish`` callable runs on each batch on the side stream too, after its copies: the trainer's
GPU augmentation, which then also overlaps the step before. Only ``torch.Tensor`` values are
copied: what ``finish`` reads on the host travels in a
:class:`~trainfuse.ultralytics.augment.decode.HostTensor`.

With ``background=True`` a thread of the prefetcher's own takes the batches from the loader and
launches them, up to ``ahead`` batches ahead of the loop: for a ``finish`` whose host time
(decoding a batch's JPEGs, which waits for the GPU) would otherwise add to each iteration's. The
thread issues CUDA work only on the side stream, which the trainers' captures (thread-local
capture mode) do not see; it stops when the loop leaves the epoch, after the batch in hand.

Everything else is the wrapped loader's: its length, dataset, sampler, ``reset()`` and ``close()``
(attribute access passes through).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class DevicePrefetcher:
    """``loader`` whose dict batches arrive with their tensors on ``device`` (see the module).

    Args:
        loader: the training loader (batches are dicts of tensors and other values).
        device: a CUDA device.
        finish: called on each batch once its copies are launched, on the side stream (the
            deferred augmentation); returns the batch the loop gets.
        background: take and launch the batches in a thread (see the module).
        ahead: batches launched ahead of the loop in the background (at least 1).

    Attributes:
        launch_ms: the host time each batch's copies and ``finish`` took, in ms (the last 1,000).
        thread_name: the name of the background thread (one per epoch, while it runs).
    """

    def __init__(self, loader: Any, device: torch.device,
                 finish: Callable[[dict], dict] | None = None, background: bool = False,
                 ahead: int = 2) -> None:
        if device.type != "cuda":
            raise ValueError(f"DevicePrefetcher: device must be a CUDA device, got {device}")
        self.loader = loader
        self.device = device
        self.finish = finish
        if ahead < 1:
            raise ValueError(f"DevicePrefetcher: ahead must be >= 1, got {ahead}")
        self.background = background
        self.ahead = ahead
        self.thread_name = f"trainfuse-prefetch-{id(self):x}"
        self.launch_ms: collections.deque[float] = collections.deque(maxlen=1000)
        self._stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # dataset, sampler, batch_size, reset, close, ...
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        launched = self._background() if self.background else self._inline()
        for batch, event in launched:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for value in batch.values():
                if isinstance(value, torch.Tensor) and value.device == self.device:
                    value.record_stream(current)
            yield batch

    def _inline(self) -> Iterator[tuple[Any, torch.cuda.Event]]:
        batches = iter(self.loader)
        ahead = self._launch(next(batches, None))
        while ahead is not None:
            current, ahead = ahead, self._launch(next(batches, None))  # runs while this one trains
            yield current

    def _background(self) -> Iterator[tuple[Any, torch.cuda.Event]]:
        done = object()
        launched: queue.Queue = queue.Queue(maxsize=self.ahead)
        stop = threading.Event()

        def work() -> None:
            try:
                with torch.cuda.device(self.device):
                    for batch in self.loader:
                        item = self._launch(batch)
                        while not stop.is_set():
                            try:
                                launched.put(item, timeout=0.05)
                                break
                            except queue.Full:
                                continue
                        if stop.is_set():
                            return
                launched.put(done)
            except BaseException as error:  # raised in the loop's thread
                launched.put(error)

        thread = threading.Thread(target=work, name=self.thread_name, daemon=True)
        thread.start()
        try:
            while (item := launched.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # the loader's iterator is the thread's until it returns
                try:
                    launched.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()

    def _launch(self, batch: Any) -> tuple[Any, torch.cuda.Event] | None:
        """Launch the copies of ``batch``'s CPU tensors on the side stream: the batch (a new dict)
        and the event the copies end with; None at the end."""
        if batch is None:
            return None
        if not isinstance(batch, dict):
            raise TypeError(f"DevicePrefetcher: the loader's batches must be dicts, got "
                            f"{type(batch).__name__}")
        stream = self._stream
        start = time.perf_counter()
        with torch.cuda.stream(stream):  # allocated from the side stream's own pool
            moved = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                     for k, v in batch.items()}
            if self.finish is not None:
                moved = self.finish(moved)
            event = torch.cuda.Event()
            event.record(stream)
        self.launch_ms.append((time.perf_counter() - start) * 1e3)
        return moved, event


__all__ = ["DevicePrefetcher"]
