"""Measuring ultralytics training runs: one timed run (:func:`train_run`), loop time per
iteration, launch counts, the optimizer phase on its own and inside the loop, and the comparison
table and PNG that ``python -m trainfuse.bench yolo`` and ``examples/yolov5/train.py`` print.

Everything here hooks into a run through ultralytics' own callbacks (``model.add_callback``); the
trainer is not touched. The training-loop time of an iteration runs from ``on_train_batch_start``
to ``on_train_batch_end`` with the GPU synchronized at both, so it holds the forward, loss,
backward and (every ``accumulate`` iterations) optimizer step; the data wait is the gap from one
iteration's end to the next's start.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from trainfuse.bench._common import format_columns


def _sync(trainer) -> None:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


class LoopTimer:
    """Per-iteration loop time, data wait and loss, and per-epoch time, of one training run.

    Args:
        sync: wait for the GPU at each iteration's start and end, so that an iteration's time is
            its GPU work and its loss is read as it ends (True); or only where an epoch starts and
            ends (False): the loop runs as a user's does, the host queueing ahead and a background
            thread's GPU work overlapping the step, its iteration and data-wait times are host
            times, and no loss is read.

    Example:
        >>> timer = LoopTimer().attach(model)            # doctest: +SKIP
        >>> model.train(data=..., epochs=3)              # doctest: +SKIP
        >>> timer.summary(batch=16)["iter_ms"]           # doctest: +SKIP
    """

    def __init__(self, sync: bool = True) -> None:
        self.sync = sync
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.epoch_of: list[int] = []
        self.losses: list[float] = []  # box + cls + dfl of each iteration (ultralytics' loss items)
        self.epoch_s: list[float] = []
        self.skip: set[int] = set()  # iterations left out of the statistics (profiled ones)
        self._epoch_start = 0.0

    def attach(self, model) -> LoopTimer:
        """Register the callbacks on ``model`` (an ultralytics ``YOLO``); returns ``self``."""
        for event in ("on_train_epoch_start", "on_train_batch_start", "on_train_batch_end",
                      "on_train_epoch_end"):
            model.add_callback(event, getattr(self, event))
        return self

    def on_train_epoch_start(self, trainer) -> None:
        _sync(trainer)
        self._epoch_start = time.perf_counter()

    def on_train_batch_start(self, trainer) -> None:
        if self.sync:
            _sync(trainer)
        self.starts.append(time.perf_counter())
        self.epoch_of.append(trainer.epoch)

    def on_train_batch_end(self, trainer) -> None:
        if not self.sync:
            self.ends.append(time.perf_counter())
            return
        _sync(trainer)
        self.ends.append(time.perf_counter())
        # the GPU is idle here: reading the loss costs no stall. The loss of this iteration per
        # image of a full batch (box + cls + dfl): trainer.loss_items may lag behind it in a
        # trainer that reads them back asynchronously
        self.losses.append(float(trainer.loss.detach()) / trainer.batch_size)

    def on_train_epoch_end(self, trainer) -> None:
        _sync(trainer)
        self.epoch_s.append(time.perf_counter() - self._epoch_start)

    def iter_ms(self) -> list[float]:
        """The loop time of every iteration, in ms."""
        return [(e - s) * 1e3 for s, e in zip(self.starts, self.ends)]

    def summary(self, batch: int, warmup: int = 5) -> dict[str, float]:
        """Medians over the iterations after the first ``warmup`` (and not in :attr:`skip`).

        Args:
            batch: images per iteration.
            warmup: iterations left out at the start (allocator and cuDNN warm-up).

        Returns:
            ``iterations``, ``iter_ms``, ``data_wait_ms``, ``epoch_s`` (median training time of
            an epoch, validation excluded), ``images_per_s`` (batch over loop time plus wait;
            NaN unsynced) and ``last_epoch_iter_ms`` (the last epoch's time over its iterations:
            the GPU waited for at its ends only, so unsynced it is what the run's clock shows).
        """
        keep = [i for i in range(warmup, len(self.ends)) if i not in self.skip]
        if not keep:
            keep = list(range(len(self.ends)))
        loop = [(self.ends[i] - self.starts[i]) * 1e3 for i in keep]
        waits = [(self.starts[i + 1] - self.ends[i]) * 1e3 for i in keep
                 if i + 1 < len(self.starts) and self.epoch_of[i + 1] == self.epoch_of[i]]
        it = statistics.median(loop) if loop else float("nan")
        wait = statistics.median(waits) if waits else 0.0
        # unsynced, an iteration's time is its host time: no rate follows from it
        rate = batch * 1e3 / (it + wait) if self.sync else float("nan")
        last = self.epoch_of[-1] if self.epoch_of else None
        in_last = sum(1 for e in self.epoch_of if e == last)
        last_ms = self.epoch_s[-1] * 1e3 / in_last if self.epoch_s and in_last else float("nan")
        return {"iterations": len(self.ends), "iter_ms": it, "data_wait_ms": wait,
                "epoch_s": statistics.median(self.epoch_s) if self.epoch_s else float("nan"),
                "images_per_s": rate, "last_epoch_iter_ms": last_ms}

    def steady_images_per_s(self, batch: int) -> float:
        """Images per second after the first epoch, the epoch ends included: from the end of the
        first epoch's last iteration to the end of the last one. The batches the loader's workers
        make ahead while an epoch ends (its checkpoint) are paid for in that time, so a loader
        slower than the step sets this rate however short the epochs. NaN with one epoch."""
        after = [i for i, e in enumerate(self.epoch_of[:len(self.ends)]) if e != self.epoch_of[0]]
        if not after or after[0] == 0:
            return float("nan")
        return batch * len(after) / (self.ends[after[-1]] - self.ends[after[0] - 1])


def device_launches(prof) -> int:
    """Kernels, copies and fills a ``torch.profiler`` run saw on the GPU (a CUDA graph's kernels
    each count)."""
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# kinds of GPU work by kernel name, first match wins: BatchNorm (cuDNN's and the fused op, its kernels writing
# into a concatenation and its one-launch kernels too), upsampling and pooling (torch's, and SPPF's and the
# neck's fused ops), cuDNN's convolutions (forward, data and weight grads: xmma/implicit-GEMM kernels), other
# matmuls (cuBLAS's nvjet kernels too, which run cuDNN's 1x1 convolutions in channels_last), copies to the
# host (a checkpoint's, the logged losses': not the step's, and on another stream where the trainer writes
# checkpoints in the background), copies and concatenation, elementwise kernels (activations, adds, casts, the
# uint8 batch made the stem's input), reductions; the rest (trainfuse's loss and optimizer kernels,
# ultralytics' own) is "other"
KERNEL_KINDS = (
    ("to host", ("memcpy dtoh",)),
    ("batchnorm", ("batch_norm", "batchnorm", "bn_", "welford", "into_apply", "into_dx", "into_grad_sums",
                   "into_stats_apply", "into_grad_dx")),
    ("upsample/pool", ("upsample", "up_concat", "max_pool", "pool_chain")),
    ("convolution", ("conv", "cudnn", "xmma", "implicit", "dgrad", "wgrad", "fprop", "nchwtonhwc",
                     "nhwctonchw")),
    ("matmul", ("gemm", "cutlass", "cublas", "nvjet")),
    ("copy/cat", ("copy", "catarray", "concat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "image_input")),
    ("reduction", ("reduce",)),
)


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel by its name (:data:`KERNEL_KINDS`), ``"other"`` when none matches."""
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def gpu_ms_by_kind(prof) -> dict[str, float]:
    """GPU milliseconds of a ``torch.profiler`` run by :func:`kernel_kind`."""
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(e.name)
            out[kind] = out.get(kind, 0.0) + e.time_range.elapsed_us() / 1e3
    return out


def top_kernels(prof, n: int = 25) -> list[tuple[str, float, int]]:
    """The ``n`` kernels of a ``torch.profiler`` run that took the most GPU time, by name: ``(name
    cut to 90 characters, GPU ms, calls)``, longest first."""
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(e.name[:90], [0.0, 0])
            entry[0] += e.time_range.elapsed_us() / 1e3
            entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:n]
    return [(name, ms, calls) for name, (ms, calls) in ranked]


# the CUDA runtime and driver calls that put work on a stream
_LAUNCH_CALLS = ("LaunchKernel", "GraphLaunch", "Memcpy", "Memset")


def host_launches(prof) -> int | None:
    """Launch calls the host made in a ``torch.profiler`` run (kernel launches, graph launches,
    copies, fills: a replayed CUDA graph counts one), or None when the profiler recorded no CUDA
    runtime calls."""
    calls = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
             and e.name.startswith(("cuda", "cu")) and any(c in e.name for c in _LAUNCH_CALLS)]
    return len(calls) or None


class LaunchCounter:
    """Profiles one accumulation cycle of a run on the GPU (from the iteration after an optimizer
    step through the next step, within one epoch) and counts the launches: :attr:`per_iteration`
    is their number over the cycle's iterations. The profiled iterations are added to
    ``timer.skip``.

    Args:
        after: iterations to let pass first (warm-up, and ultralytics' warmup ramp if wanted).
        timer: the run's :class:`LoopTimer` (its statistics leave the profiled iterations out).
    """

    def __init__(self, after: int, timer: LoopTimer | None = None) -> None:
        self.after, self.timer = after, timer
        self.seen = 0
        self.iterations = 0
        self.launches = 0
        self.host_launches: int | None = None
        self.gpu_ms: dict[str, float] = {}
        self.top: list[tuple[str, float, int]] = []
        self._updates = None
        self._stepped = False
        self._prof = None
        self.done = False
        self._epoch = None
        self._epoch_first = 0  # index of the epoch's first iteration

    def attach(self, model) -> LaunchCounter:
        model.add_callback("on_train_batch_start", self.on_train_batch_start)
        model.add_callback("on_train_batch_end", self.on_train_batch_end)
        return self

    @property
    def per_iteration(self) -> float | None:
        return self.launches / self.iterations if self.iterations else None

    @property
    def host_per_iteration(self) -> float | None:
        return self.host_launches / self.iterations if self.iterations and self.host_launches else None

    def on_train_batch_start(self, trainer) -> None:
        if trainer.epoch != self._epoch:
            self._epoch, self._epoch_first = trainer.epoch, self.seen
        if self.done or trainer.device.type != "cuda" or self._prof is not None:
            return
        left_in_epoch = len(trainer.train_loader) - (self.seen - self._epoch_first)
        if self.seen >= self.after and self._stepped and left_in_epoch >= trainer.accumulate:
            _sync(trainer)
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._prof.start()

    def on_train_batch_end(self, trainer) -> None:
        # an optimizer step counts one EMA update, in ultralytics' trainer and in ours
        updates = trainer.ema.updates
        self._stepped = self._updates is not None and updates != self._updates
        self._updates = updates
        index = self.seen
        self.seen += 1
        if self._prof is None:
            return
        self.iterations += 1
        if self.timer is not None:
            self.timer.skip.add(index)
        if self._stepped:
            _sync(trainer)
            self._prof.stop()
            self.launches = device_launches(self._prof)
            self.host_launches = host_launches(self._prof)
            self.gpu_ms = gpu_ms_by_kind(self._prof)
            self.top = top_kernels(self._prof)
            self._prof = None
            self.done = True


class PhaseHostTimer:
    """Host time of each ``trainer.optimizer_step()`` inside the training loop, no sync around it
    (what the phase's Python and launches cost the host), the first ``skip`` calls left out.

    Example:
        >>> timer = PhaseHostTimer().attach(model)       # doctest: +SKIP
        >>> model.train(data=..., epochs=3)              # doctest: +SKIP
        >>> timer.median_ms                              # doctest: +SKIP
    """

    def __init__(self, skip: int = 20) -> None:
        self.skip, self.calls = skip, 0
        self.ms: list[float] = []

    def attach(self, model) -> PhaseHostTimer:
        model.add_callback("on_train_start", self.on_train_start)
        model.add_callback("on_train_end", self.on_train_end)
        return self

    def on_train_start(self, trainer) -> None:
        step = trainer.optimizer_step

        def timed() -> None:
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            self.calls += 1
            if self.calls > self.skip:
                self.ms.append((t1 - t0) * 1e3)

        trainer.optimizer_step = timed  # the instance's, for the loop only

    def on_train_end(self, trainer) -> None:
        trainer.__dict__.pop("optimizer_step", None)

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.ms) if self.ms else None


def optimizer_phase(trainer, calls: int = 50, warmup: int = 5,
                    kept: bool | None = None) -> tuple[list[float], int | None]:
    """Time ``trainer.optimizer_step()`` (unscale, clip, step, EMA, zero_grad) on its own: the
    wall time of each call in ms, the GPU synchronized before and after, on gradients of
    realistic size re-attached between calls; and the launches of one call (CUDA only).

    The grads reach each call as the trainer's backward left them in training: fresh tensors
    (stock, and eager trainers, whose ``zero_grad`` frees them), or the same tensors refilled in
    place for a trainer whose CUDA graphs accumulated into kept grads (``kept``; None: the
    trainer's ``keeps_grads`` now, which is False once training ended and the graphs went: the run
    says what it was, :func:`train_run`'s ``kept_grads``).

    Returns:
        ``(times, launches)``.
    """
    model = trainer.model
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    scale = trainer.scaler.scale(torch.ones((), device=device)) if trainer.scaler.is_enabled() else 1.0
    # small gradients (norm well below the clip at 10), scaled as the backward leaves them
    grads = [torch.randn_like(p) * 1e-4 * scale for p in params]
    if kept is None:
        kept = getattr(trainer, "keeps_grads", False)
    kept = [g.clone() for g in grads] if kept else None

    def attach() -> None:
        if kept is None:
            for p, g in zip(params, grads):
                p.grad = g.clone()
        else:
            torch._foreach_copy_(kept, grads)
            for p, g in zip(params, kept):
                p.grad = g

    times = []
    # as timeit does, the cyclic garbage collector is off inside each timed call: a collection
    # set off there by this loop's own fresh grad tensors would otherwise land on whichever call
    # happens to cross the threshold (a few hundred us: the size of a whole fused phase)
    enabled = gc.isenabled()
    try:
        for k in range(warmup + calls):
            attach()
            _sync(trainer)
            gc.disable()
            t0 = time.perf_counter()
            trainer.optimizer_step()
            _sync(trainer)
            t1 = time.perf_counter()
            if enabled:
                gc.enable()
            if k >= warmup:
                times.append((t1 - t0) * 1e3)
    finally:
        if enabled:
            gc.enable()
    launches = None
    if device.type == "cuda":
        attach()
        _sync(trainer)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            trainer.optimizer_step()
            _sync(trainer)
        launches = device_launches(prof)
    return times, launches


# each task's headline pair of ultralytics' metrics: masks, keypoints, boxes; top-1 and top-5 accuracy
_TASK_METRICS = {"segment": "(M)", "pose": "(P)", "detect": "(B)", "obb": "(B)"}


def final_map(trainer) -> tuple[float | None, float | None]:
    """mAP50 and mAP50-95 of the run's final validation (ultralytics' validator, best.pt): of the
    masks for segmentation, of the keypoints for pose, of the boxes otherwise; for classification
    its top-1 and top-5 accuracy."""
    metrics = trainer.metrics or {}
    if trainer.args.task == "classify":
        return metrics.get("metrics/accuracy_top1"), metrics.get("metrics/accuracy_top5")
    kind = _TASK_METRICS.get(trainer.args.task, "(B)")
    return metrics.get(f"metrics/mAP50{kind}"), metrics.get(f"metrics/mAP50-95{kind}")


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def runs_table(runs: dict[str, dict]) -> str:
    """The comparison table of ``runs`` (name -> :meth:`LoopTimer.summary` plus ``map50`` and
    ``map50_95``), one aligned row per run."""
    header = ["run", "iter ms (median)", "data wait ms", "epoch s", "images/s", "mAP50", "mAP50-95"]
    rows = [[name, _fmt(r["iter_ms"]), _fmt(r["data_wait_ms"]), _fmt(r["epoch_s"]),
             _fmt(r["images_per_s"], 0), _fmt(r.get("map50"), 3), _fmt(r.get("map50_95"), 3)]
            for name, r in runs.items()]
    return format_columns(header, rows)


def plot_runs(runs: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """Loss curves and per-iteration loop time of each run (``losses`` and ``iter_ms_all`` of
    its summary) in one PNG.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        ax_loss.plot(r["losses"], label=name, linewidth=1)
        ax_time.plot(r["iter_ms_all"], label=f"{name} (median {r['iter_ms']:.1f} ms)", linewidth=1)
    ax_loss.set(xlabel="iteration", ylabel="loss (box + cls + dfl)", title="training loss")
    ax_time.set(xlabel="iteration", ylabel="ms",
                title="training-loop time per iteration (data wait excluded)")
    ax_time.set_yscale("log")
    for ax in (ax_loss, ax_time):
        ax.legend()
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train_run(kind: str, args, data: str, project: Path, device: int | str = 0,
              cache: str | bool = "ram", name: str | None = None, train_args: dict | None = None,
              unsynced: bool = False, **trainer_kwargs) -> tuple[dict, object]:
    """One timed training run of ``kind`` (``stock`` or ``trainfuse``, the latter built with
    ``trainer_kwargs``) in ``project/<name or kind>``: its summary and trainer. ``train_args``:
    more of ``model.train``'s arguments. ``unsynced``: the loop runs as a user's does (a
    :class:`LoopTimer` without per-iteration syncs, no profiled iterations, no loss read back), for
    rates over whole epochs."""
    from ultralytics import YOLO

    from trainfuse.ultralytics import trainer_for

    model = YOLO(args.model)
    trainer_cls = trainer_for(model)
    timer = LoopTimer(sync=not unsynced).attach(model)
    phase_timer = PhaseHostTimer().attach(model)
    # one accumulation cycle is profiled: after ultralytics' warmup ramp of accumulate (3 epochs),
    # or after 8 iterations in a run too short for that
    nb = -(-args.images // args.batch)
    ramp = round(min(3, args.epochs - 1) * nb)
    counter = LaunchCounter(after=ramp + 8 if ramp + 16 <= args.epochs * nb else 8, timer=timer)
    if not unsynced:
        counter.attach(model)
    kept: dict[str, bool] = {}  # whether the graphs kept the grads, read before the trainer undoes them
    model.add_callback("on_train_end", lambda t: kept.setdefault("grads", getattr(t, "keeps_grads", False)))
    fused = functools.partial(trainer_cls, **trainer_kwargs) if trainer_kwargs else trainer_cls
    extra = {"trainer": fused} if kind == "trainfuse" else {}
    torch.cuda.reset_peak_memory_stats()
    model.train(data=data, epochs=args.epochs, batch=args.batch, imgsz=args.imgsz, seed=args.seed,
                workers=args.workers, cache=cache, deterministic=False, val=False, plots=False, device=device,
                project=str(project), name=name or kind, exist_ok=True, verbose=False,
                optimizer=args.optimizer,
                **extra, **(train_args or {}))
    trainer = model.trainer
    summary = timer.summary(args.batch)
    summary["steady_images_per_s"] = timer.steady_images_per_s(args.batch)
    summary["map50"], summary["map50_95"] = final_map(trainer)
    summary["trainer"] = trainer_cls.__name__ if kind == "trainfuse" else type(trainer).__name__
    summary["launches_per_iteration"] = counter.per_iteration
    summary["profiled_iterations"] = counter.iterations
    if counter.iterations:
        summary["gpu_ms_by_kind"] = {k: v / counter.iterations for k, v in sorted(counter.gpu_ms.items())}
        summary["top_kernels"] = [[name, ms / counter.iterations, calls / counter.iterations]
                                  for name, ms, calls in counter.top]
    summary["optimizer"] = type(trainer.optimizer).__name__
    summary["kept_grads"] = kept.get("grads", False)
    summary["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    summary["host_launches_per_iteration"] = counter.host_per_iteration
    summary["phase_host_ms"] = phase_timer.median_ms
    launches = getattr(trainer.train_loader, "launch_ms", None)  # the prefetcher's host time per batch
    if launches:
        summary["prefetch_host_ms"] = statistics.median(launches)
    decoder = getattr(trainer, "jpeg_decoder", None)
    if decoder is not None:
        summary["jpeg_decoded"], summary["jpeg_reused"] = decoder.decoded, decoder.reused
        summary["jpeg_received_mb"] = decoder.received / 2**20
    if getattr(trainer, "phase_stats", None) is not None:
        summary["phase_graph"] = trainer.phase_stats
    if getattr(trainer, "graph_stats", None) is not None:
        summary["graphs"] = dataclasses.asdict(trainer.graph_stats)
    summary["losses"], summary["iter_ms_all"] = timer.losses, timer.iter_ms()
    return summary, trainer


__all__ = ["LaunchCounter", "LoopTimer", "PhaseHostTimer", "device_launches", "final_map", "host_launches",
           "optimizer_phase", "plot_runs", "runs_table", "train_run"]
