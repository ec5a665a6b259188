"""ultralytics' figures drawn in worker processes while the run goes on (``parallel_plots=True``).

With ``plots=True``, ultralytics' default, a detection run draws its figures with matplotlib on the
training process, one after another: the labels' statistics at setup, and at the last epoch's
validation and again at the final one four curves (precision-recall, F1, precision, recall; eight
for segmentation and pose) and two confusion matrices, each a few hundred milliseconds of CPU
while the GPU waits. Here :class:`PlotWorkers` hands each figure to a Python process of its own
(``python -m trainfuse.ultralytics.plot_worker``, started ahead of the validation that needs it, so
its imports are done when the figure comes), and :class:`DeferredPlots` makes a validator send
them there: the curves are drawn from a copy of the metrics' statistics taken before
``metrics.process`` (which the worker runs again, drawing its share of the curves), the confusion
matrices from a copy of the matrix. The validator waits for its figures before ``on_val_end``, so
callbacks and the user see the same files, registered through the same ``on_plot``, as stock's;
the labels' figure is waited for before ``on_train_end``.

Subprocesses, not ``multiprocessing``: its ``spawn`` and ``forkserver`` start methods import the
user's main script again, which a training script without a ``__main__`` guard would re-run.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

WORKER = "trainfuse.ultralytics.plot_worker"
CURVE_PARTS = 4  # curve figures of one metrics.process split over this many workers


def default_workers() -> int:
    """Workers for one validation's figures (curves in ``CURVE_PARTS`` parts, two matrices), at most
    half the CPUs."""
    return max(1, min(CURVE_PARTS + 2, (os.cpu_count() or 2) // 2))


def framed(data: bytes) -> bytes:
    """``data`` behind its length (8 bytes, little-endian): how jobs and answers travel."""
    return len(data).to_bytes(8, "little") + data


def read_framed(fd: int, alive: Callable[[], bool] = lambda: True) -> bytes:
    """One :func:`framed` message from file descriptor ``fd``, read to its length, not to the end of
    the stream: a process forked from ours (a data loader's worker) may hold the pipe's other end
    open, so the end may never come. ``alive`` says whether the writer still runs; it is asked
    while nothing arrives, and a message cut off by its end raises ``EOFError``."""
    data, need = b"", 8
    for size in (8, None):
        while len(data) < need:
            ready, _, _ = select.select([fd], [], [], 0.5)
            chunk = os.read(fd, min(need - len(data), 1 << 20)) if ready else None
            if chunk == b"" or (chunk is None and not alive() and not select.select([fd], [], [], 0)[0]):
                raise EOFError(f"the message ended after {len(data)} of {need} bytes")
            data += chunk or b""
        if size is None:
            return data[8:]
        need = 8 + int.from_bytes(data[:8], "little")
    raise AssertionError("unreachable")


class _Job:
    """One figure job in its worker process; a thread feeds it and reads its answer."""

    def __init__(self, process: subprocess.Popen, payload: bytes, on_plot: Callable | None) -> None:
        self.on_plot = on_plot
        self.names: list[str] = []
        self.error: str | None = None
        self.drawing = self.turnaround = 0.0  # seconds: the call in the worker; sent to answered
        self._process = process
        self._thread = threading.Thread(target=self._talk, args=(payload,), daemon=True)
        self._thread.start()

    def _talk(self, payload: bytes) -> None:
        process = self._process
        start = time.perf_counter()
        try:
            process.stdin.write(framed(payload))
            process.stdin.close()
            status, value, *seconds = pickle.loads(read_framed(process.stdout.fileno(),
                                                               lambda: process.poll() is None))
            self.drawing = seconds[0] if seconds else 0.0
            self.turnaround = time.perf_counter() - start
        except EOFError:
            status, value = "error", f"the worker ended without an answer (exit code {process.wait()})"
        except Exception as error:  # noqa: BLE001 - reported by wait(), on the training thread
            status, value = "error", f"{type(error).__name__}: {error}"
        finally:
            process.stdout.close()
        process.wait()  # it exits right after its answer
        if status == "ok":
            self.names = value
        else:
            self.error = value

    def join(self) -> None:
        self._thread.join()


class PlotWorkers:
    """Worker processes that draw one figure each, then exit; ``ready`` starts them ahead.

    Args:
        workers: how many to keep ready for one validation (:func:`default_workers`).
    """

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self.files: list[str] = []  # what the figures waited for wrote, in the order asked
        self.times: list[tuple[float, float]] = []  # (drawing, turnaround) seconds of each, likewise
        self._idle: list[subprocess.Popen] = []
        self._jobs: list[_Job] = []

    def ready(self, n: int | None = None) -> None:
        """Have ``n`` workers (default: ``workers``) started and waiting for a figure."""
        while len(self._idle) < (self.workers if n is None else n):
            self._idle.append(subprocess.Popen([sys.executable, "-m", WORKER], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE))

    def call(self, target: Any, name: str, args: tuple = (), kwargs: dict | None = None,
             on_plot: Callable | None = None, curves: tuple[int, int] | None = None) -> None:
        """Draw ``getattr(target, name)(*args, **kwargs)`` in a worker (``target``: an object, a
        copy of it is sent, or a module's name), with ``on_plot`` given the names of the files it
        wrote once :meth:`wait` returns; ``curves=(part, parts)`` draws only every ``parts``-th of
        the curve figures it makes, from the ``part``-th on."""
        payload = pickle.dumps((target, name, args, kwargs or {}, on_plot is not None, curves))
        if not self._idle:
            self.ready(1)
        self._jobs.append(_Job(self._idle.pop(0), payload, on_plot))

    def wait(self) -> None:
        """Wait for every figure asked for; register the files through their ``on_plot`` in the order
        asked; raise the first worker's error."""
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.join()
        errors = [job.error for job in jobs if job.error is not None]
        for job in jobs:
            self.files += job.names
            self.times.append((job.drawing, job.turnaround))
            for name in job.names:
                job.on_plot(name)
        if errors:
            raise RuntimeError(f"a figure failed in its worker process ({len(errors)} of {len(jobs)}):\n"
                               f"{errors[0]}")

    def timing(self) -> str:
        """``": each 0.4-0.9 s to draw, 0.5-1.2 s from sent to answered"`` over the jobs waited for
        ("" with none): what a figure cost in its worker, and what the waiting side saw."""
        if not self.times:
            return ""
        drawing, turnaround = zip(*self.times)
        return (f": each {min(drawing):.1f}-{max(drawing):.1f} s to draw, {min(turnaround):.1f}-"
                f"{max(turnaround):.1f} s from sent to answered")

    def close(self) -> None:
        """Stop the workers still waiting for a figure (figures asked for are waited for first)."""
        try:
            self.wait()
        finally:
            idle, self._idle = self._idle, []
            for process in idle:
                process.kill()
                process.communicate()


class _Forward:
    """Reads and writes of attributes go to ``target``, but for what the subclass defines."""

    def __init__(self, target: Any, workers: PlotWorkers) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_workers", workers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)


class _Metrics(_Forward):
    """A validator's metrics whose ``process(..., plot=True)`` computes without drawing and sends
    its curves to the workers, drawn from a copy of the statistics taken first."""

    def process(self, *args, **kwargs):
        if not kwargs.get("plot"):
            return self._target.process(*args, **kwargs)
        on_plot = kwargs.pop("on_plot", None)
        kwargs["plot"] = False
        state = pickle.dumps(self._target)  # before process: it may change what it reads
        result = self._target.process(*args, on_plot=on_plot, **kwargs)
        kwargs["plot"] = True
        target = pickle.loads(state)
        for part in range(CURVE_PARTS):
            self._workers.call(target, "process", args, kwargs, on_plot, curves=(part, CURVE_PARTS))
        return result


class _Matrix(_Forward):
    """A validator's confusion matrix whose ``plot`` draws in a worker."""

    def plot(self, *args, **kwargs):
        on_plot = kwargs.pop("on_plot", None)
        self._workers.call(self._target, "plot", args, kwargs, on_plot)


class DeferredPlots:
    """A mixin for an ultralytics validator: with ``plot_workers`` set and ``args.plots``, the
    figures of ``get_stats`` and ``finalize_metrics`` are drawn by the workers, waited for in
    ``print_results`` (before ``on_val_end``)."""

    plot_workers: PlotWorkers | None = None

    def _deferring(self) -> PlotWorkers | None:
        return self.plot_workers if self.args.plots else None

    def get_stats(self):
        workers = self._deferring()
        if workers is None:
            return super().get_stats()
        metrics = self.metrics
        self.metrics = _Metrics(metrics, workers)
        try:
            return super().get_stats()
        finally:
            self.metrics = metrics

    def finalize_metrics(self) -> None:
        workers = self._deferring()
        if workers is None:
            return super().finalize_metrics()
        matrix = getattr(self, "confusion_matrix", None)
        if matrix is None:
            return super().finalize_metrics()
        self.confusion_matrix = deferred = _Matrix(matrix, workers)
        try:
            super().finalize_metrics()
        finally:
            self.confusion_matrix = matrix
            if getattr(self.metrics, "confusion_matrix", None) is deferred:
                self.metrics.confusion_matrix = matrix

    def print_results(self) -> None:
        super().print_results()
        workers = self._deferring()
        if workers is not None:
            workers.wait()
            if self.training:  # the next validation that plots is the final one: importing ahead
                workers.ready()


_DEFERRED: dict[type, type] = {}


def deferring(validator: Any, workers: PlotWorkers | None) -> Any:
    """``validator`` (an ultralytics validator) drawing its figures in ``workers``; None leaves it as
    it is."""
    if workers is None:
        return validator
    cls = type(validator)
    if not isinstance(validator, DeferredPlots):
        if cls not in _DEFERRED:  # named as the validator it extends: reports and logs read the same
            _DEFERRED[cls] = type(cls.__name__, (DeferredPlots, cls),
                                  {"__module__": __name__, "__qualname__": cls.__qualname__})
        validator.__class__ = _DEFERRED[cls]
    validator.plot_workers = workers
    return validator


def label_arrays(labels: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The boxes and classes of a detection dataset's ``labels``, as ultralytics' detection trainer
    plots them."""
    boxes = np.concatenate([lb["bboxes"] for lb in labels], 0)
    cls = np.concatenate([lb["cls"] for lb in labels], 0)
    return boxes, cls.squeeze()


__all__ = ["CURVE_PARTS", "DeferredPlots", "PlotWorkers", "default_workers", "deferring", "label_arrays"]
