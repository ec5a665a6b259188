"""What every fused ultralytics trainer adds to its task's trainer (:class:`FusedTrainer`):
``YOLO("yolov5n.yaml").train(data="data.yaml", trainer=FusedDetectionTrainer)``, and the same for
segmentation, pose, OBB and classification (:mod:`trainfuse.ultralytics.task_trainers`).

Once ultralytics has set up the run, the trainer makes its changes (:mod:`trainfuse.ultralytics.
changes`, each with a row in its ``report``) and undoes them in reverse when training ends or
raises, and around a checkpoint load; the training batches load through
:class:`~trainfuse.ultralytics.loading.BatchLoading`. What a task cannot use yet (a fused loss,
the GPU augmentation of its labels, the fused validator) stays stock, and its row says why.
ultralytics itself is not patched, and its checkpoints stay stock (docs/integrations.md: what
changes, and where results differ on purpose).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from typing_extensions import override
from ultralytics.cfg import get_cfg
from ultralytics.engine.trainer import BaseTrainer
from ultralytics.models.yolo.detect import DetectionTrainer
from ultralytics.utils import DEFAULT_CFG, LOGGER, RANK, colorstr
from ultralytics.utils.torch_utils import unwrap_model

from trainfuse.clients import ON, SWAPPED, AppliedChanges, Report, Row
from trainfuse.optim import FusedOptimizer
from trainfuse.ultralytics import compat
from trainfuse.ultralytics.changes import CALLBACKS, Options, Results, Run, blocks, changes
from trainfuse.ultralytics.changes.image_input import device_batch
from trainfuse.ultralytics.changes.loss import takes_fused_loss
from trainfuse.ultralytics.changes.optimizer import TorchLayoutOptimizer, fused_phase
from trainfuse.ultralytics.checkpoint import CheckpointWriter
from trainfuse.ultralytics.loading import BatchLoading
from trainfuse.ultralytics.plots import PlotWorkers, deferring, label_arrays
from trainfuse.ultralytics.tasks import check_task
from trainfuse.ultralytics.warm_start import KernelsAhead

_PREFIX = colorstr("trainfuse:")
OPTIONS = ("cuda_graphs", "gpu_augment", "fused_loss", "fuse_casts", "fold_stem", "fuse_blocks", "prefetch",
           "parallel_plots", "device_cache", "cudnn_benchmark", "raw_images")
# what None, the default, means for the options that take it
_NONE_MEANS = {"gpu_augment": "on for CUDA where images are read from disk", "device_cache": "on for CUDA",
               "fuse_blocks": "on for detection models of 5M parameters or more on one CUDA device"}


class FusedTrainer(compat.TrainerHooks, BaseTrainer):
    """What every fused trainer adds to the ultralytics trainer of its task (see the module
    docstring); a subclass names the task (``task``) and puts this class before ultralytics' own:
    ``class FusedSegmentationTrainer(FusedTrainer, SegmentationTrainer)``.

    Options are keywords of the constructor (``trainer=functools.partial(FusedDetectionTrainer,
    cuda_graphs=False)``); the class attributes of the same names are their defaults, and under DDP,
    whose ranks rebuild the trainer from its class, set them in a subclass instead.

    Args:
        cuda_graphs: run forward, loss and backward (and the optimizer phase) from CUDA graphs
            where safe (default True).
        gpu_augment: augment the training batches on the GPU: True, False, or None (the default:
            on for CUDA where the images are read from disk; :class:`~trainfuse.ultralytics.loading.
            BatchLoading`).
        fused_loss: train with the fused, sync-free loss where the task has one (default True;
            False keeps ultralytics' loss and fuses the optimizer phase only).
        fuse_casts: under AMP on CUDA, 16-bit weights with float32 masters (default True).
        fold_stem: on CUDA, the first convolution on the space-to-depth image (default True).
        fuse_blocks: each ``Conv`` block's BatchNorm2d and SiLU as one op, the CSP blocks'
            concatenations written in place, SPPF's poolings as one op, and under AMP the neck's
            upsamplings joined to their concatenations, each giving stock's numbers: True, False, or
            None (the default: on for detection models of 5M parameters or more, YOLO11s and up,
            on one CUDA device; :mod:`trainfuse.ultralytics.changes.blocks`).
        prefetch: on CUDA, the training batches copied to the GPU one ahead (default True).
        parallel_plots: with ``plots=True``, the figures drawn in worker processes while the run
            goes on (default False: on an H200 a default run's final evaluation took longer with
            them; :mod:`trainfuse.ultralytics.plots`).
        device_cache: keep the training images the GPU decoded and the validation batches on the
            device between epochs, within a tenth of its memory: True, False, or None (the default:
            on for CUDA; :mod:`trainfuse.ultralytics.changes.cache`).
        cudnn_benchmark: on CUDA, cuDNN times the training step's convolution algorithms once per
            shape (``torch.backends.cudnn.benchmark`` during the training epochs, the user's setting
            for validation; default False: :mod:`trainfuse.ultralytics.changes.conv_algorithms`).
        raw_images: the training batches reach the model as uint8 images, which its first
            convolution turns into its input (``x / 255`` in its dtype and layout) in one kernel,
            stock's values (default False: :mod:`trainfuse.ultralytics.changes.image_input`).

    Attributes:
        report: what the trainer changed and what it left stock, with why (rows of
            :class:`trainfuse.clients.Row`; each is also logged).
        loading: the training batches' loading (``augment_reason``, ``jpeg_decoder``).
        checkpoints: writes its checkpoints in the background (a :class:`CheckpointWriter`).
        plotted_in_workers: the figures the last run's plot workers wrote (``parallel_plots``).
    """

    task: ClassVar[str]  # the ultralytics task it trains ("detect", "segment", ...)
    cuda_graphs = True
    gpu_augment: bool | None = None
    fused_loss = True
    fuse_casts = True
    fold_stem = True
    fuse_blocks: bool | None = None
    prefetch = True
    parallel_plots = False
    device_cache: bool | None = None
    cudnn_benchmark = False
    raw_images = False

    def __init__(self, cfg=DEFAULT_CFG, overrides: dict | None = None, *args, **kwargs):
        options = {name: kwargs.pop(name) for name in OPTIONS if name in kwargs}
        options = {name: value for name, value in options.items() if value is not None}
        for name, value in options.items():
            if not isinstance(value, bool):
                default = _NONE_MEANS.get(name, "True")
                raise TypeError(f"{type(self).__name__}: {name} must be True, False or None (the default: "
                                f"{default}), got {value!r}")
        compat.warn_if_untested()
        # before ultralytics checks the dataset, which fails first
        check_task(type(self), get_cfg(cfg, overrides))
        super().__init__(cfg, overrides, *args, **kwargs)
        # compiling while ultralytics sets the run up
        fused = blocks.likely_fused(options.get("fuse_blocks", self.fuse_blocks), self.args.task,
                                    self.args.model, self.world_size)
        self.kernels = KernelsAhead(self.device, blocks=fused)
        check_task(type(self), self.args)
        for name, value in options.items():
            setattr(self, name, value)
        self.report = Report(type(self).__name__)
        self.loading = BatchLoading(self.gpu_augment, self.prefetch)
        self.checkpoints = CheckpointWriter()
        self._plots: PlotWorkers | None = None
        self.plotted_in_workers: list[str] = []
        self._run: Run | None = None
        self._applied: AppliedChanges[Run] = AppliedChanges(self.report, self._log)
        # first in line, so that every other epoch-end callback sees the exact loss means; the
        # dict may be the YOLO object's, shared with its later trainers: once only
        for event, callback in CALLBACKS.items():
            if callback not in self.callbacks[event]:
                self.callbacks[event].insert(0, callback)

    @staticmethod
    def _log(row: Row) -> None:
        LOGGER.info(f"{_PREFIX} {row.kind} {row.action}: {row.detail}")

    # ---- what it changed (and what the last run's graphs did) ----------------------------------------
    @property
    def fused_reason(self) -> str:
        """Empty when the optimizer is fused, else why it stayed stock."""
        return self.report.reason("optimizer", SWAPPED, "the optimizer is not built yet")

    @property
    def graphs_reason(self) -> str:
        """Empty when the step runs from CUDA graphs, else why it runs eagerly."""
        return self.report.reason("graphs", ON, "training has not started")

    augment_reason = property(lambda self: self.loading.augment_reason,
                              doc="Empty when the training batches are augmented on the GPU, else why not.")
    jpeg_decoder = property(lambda self: self.loading.jpeg_decoder,
                            doc="The GPU JPEG decoder of the training batches, or None.")

    @property
    def fused(self) -> bool:
        """Whether the optimizer phase runs fused (a trainfuse optimizer was built)."""
        return isinstance(getattr(self, "optimizer", None), FusedOptimizer)

    @property
    def graphed_loss(self):
        """The running step's :class:`~trainfuse.ultralytics.graphed.GraphedLoss`, or None; while
        there is one, ``optimizer_step`` leaves the grads for the next replay to zero."""
        return None if self._run is None else self._run.graphed

    keeps_grads = property(lambda self: self.graphed_loss is not None)

    @property
    def results(self) -> Results:
        """What the last run's graphs did: ``graph_stats`` (:attr:`~trainfuse.graphs.CapturedStep.
        stats`), ``graph_memory``, ``phase_stats`` (the optimizer phase's eager calls, captures,
        replays and runs inside the step's graphs), each None where they did not run."""
        return Results() if self._run is None else self._run.results

    graph_stats = property(lambda self: self.results.graph_stats)
    graph_memory = property(lambda self: self.results.graph_memory)
    phase_stats = property(lambda self: self.results.phase_stats)

    # ---- when it acts --------------------------------------------------------------------------------
    @override
    def train(self):
        """ultralytics' ``train``, with the changes undone when it ends or raises; under DDP, a
        warning for options given to the constructor (the ranks rebuild the trainer from its class)."""
        for name in OPTIONS:
            if self.ddp and getattr(self, name) != getattr(type(self), name):
                LOGGER.warning(f"{_PREFIX} {name}={getattr(self, name)} does not reach the DDP ranks, which "
                               f"rebuild the trainer from its class: use a subclass that sets {name}")
        try:
            result = super().train()
        except BaseException:
            self._end(failed=True)
            raise
        self._end(failed=False)
        return result

    @override
    def after_setup(self) -> None:
        """Make the changes (ultralytics has built everything and loaded a resumed checkpoint)."""
        self.report.clear()
        if line := self.kernels.started():
            LOGGER.info(f"{_PREFIX} {line}")
        self._run = Run(self, Options(self.fused_loss, self.fuse_casts, self.cuda_graphs, self.fold_stem,
                                      self.fuse_blocks, self.device_cache, self.cudnn_benchmark,
                                      self.raw_images),
                        self.loading)
        self._applied.apply(changes(self._run.options), self._run)

    @override
    def around_checkpoint_load(self, load: Callable[[], None]) -> None:
        """Undo the changes, load, make them again (the weights may change storage, the EMA and
        the scaler are made anew by the load)."""
        if not self._applied:
            return load()
        self._run.reloading = True
        try:
            made = self._applied.restore(self._run, failed=False)
            load()
            self._applied.apply(made, self._run, report=False)
        finally:
            self._run.reloading = False

    @override
    def before_checkpoint_read(self) -> None:
        self.checkpoints.flush()

    def _end(self, *, failed: bool) -> None:
        if line := self.kernels.finished():
            LOGGER.info(f"{_PREFIX} {line}")
        self.kernels.remember()
        if self._run is not None:
            self._applied.restore(self._run, failed=failed)
            stats = self._run.results.graph_stats
            if stats is not None and stats.captures:
                LOGGER.info(f"{_PREFIX} captured {stats.captures} CUDA graphs of the step in "
                            f"{stats.capture_s:.1f} s (each shape's first batch ran eagerly: {stats.eager} "
                            "batches)")
        self.checkpoints.close(raise_error=not failed)  # a failed run raises its own error
        self._close_plots(raise_error=not failed)

    def notify(self, event: str) -> None:
        """A moment of the loop (``epoch_starts``, ``epoch_ends``) for the applied changes."""
        if event == "epoch_ends":  # ultralytics updates the EMA's attributes next, then validates it
            self.checkpoints.wait_copied()
        if event == "epoch_starts" and self._plots is not None and (
                self.epoch == self.epochs - 1 or self.stopper.possible_stop):
            self._plots.ready()  # this epoch's validation plots (ultralytics' rule): importing ahead
        for change in self._applied:
            getattr(change, event)(self._run)

    # ---- the figures ---------------------------------------------------------------------------------
    def plot_workers(self) -> PlotWorkers | None:
        """The processes drawing this run's figures (``parallel_plots``, ``plots=True``, the rank
        that plots), started on first use; else None."""
        if not (self.parallel_plots and self.args.plots and RANK in {-1, 0}):
            return None
        if self._plots is None:
            self._plots = PlotWorkers()
        return self._plots

    def plots_in_workers(self, validator):
        """``validator`` drawing its figures in :meth:`plot_workers` where there are any."""
        return deferring(validator, self.plot_workers())

    @override
    def get_validator(self):
        return self.plots_in_workers(super().get_validator())

    @override
    def plot_training_labels(self):
        """The detection tasks' figure of the labels, drawn by a worker (waited for in
        ``plot_metrics``); else ultralytics' own."""
        workers = self.plot_workers()
        if workers is None or not isinstance(self, DetectionTrainer):
            return super().plot_training_labels()
        boxes, cls = label_arrays(self.train_loader.dataset.labels)
        workers.call("ultralytics.utils.plotting", "plot_labels", (boxes, cls),
                     {"names": self.data["names"], "save_dir": self.save_dir}, on_plot=self.on_plot)

    @override
    def plot_metrics(self):
        super().plot_metrics()
        self._close_plots(raise_error=True)  # every figure is on disk before on_train_end

    def _close_plots(self, *, raise_error: bool) -> None:
        workers, self._plots = self._plots, None
        if workers is None:
            return
        try:
            workers.close()
        except RuntimeError:
            if raise_error:
                raise
        finally:
            self.plotted_in_workers = workers.files
        LOGGER.info(f"{_PREFIX} {len(workers.files)} figures drawn by worker processes (parallel_plots)"
                    f"{workers.timing()}")

    # ---- the step ------------------------------------------------------------------------------------
    @override
    def optimizer_step(self):
        """Unscale, clip at 10, step, EMA update, scale update and zero_grad: two launches when
        fused (with graphs, one replay of them, or nothing left where the iteration's graph ran
        them), else ultralytics' own phase. With graphs the grads stay for the next replay to zero;
        under DDP with graphs, they are averaged over the ranks first."""
        for change in self._applied:
            change.before_optimizer_step(self._run)
        graphed = self.graphed_loss
        if graphed is not None and graphed.optimizer_stepped():
            pass  # this iteration's graph ran the phase after its backward, then zeroed the grads
        elif not self.fused:
            return super().optimizer_step()  # its zero_grad frees the grads: the next replay zeroes them
        else:
            if self._run is not None and self._run.phase is not None:
                self._run.phase()  # replayed from its graph once steady
            else:
                fused_phase(self.optimizer, self.scaler)
            if graphed is not None:
                graphed.zero_grad()  # inside the next replay's graph
            else:
                self.optimizer.zero_grad()
        if self.ema:
            self.ema.update(self.model)  # counts nothing while attached: the step did this update

    # ---- the training batches ---------------------------------------------------------------------
    @override
    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None):
        dataset = super().build_dataset(img_path, mode, batch)
        if mode != "train":
            return dataset
        return self.loading.training_dataset(dataset, self.args, self.device, batch, pad=self._pads_labels())

    @override
    def get_dataloader(self, dataset_path: str, batch_size: int = 16, rank: int = 0, mode: str = "train"):
        loader = super().get_dataloader(dataset_path, batch_size, rank, mode)
        return self.loading.training_loader(loader, self.device) if mode == "train" else loader

    @override
    def preprocess_batch(self, batch: dict) -> dict:
        """ultralytics' preprocessing, or where the model takes uint8 images (``raw_images``) its
        moves to the device only."""
        batch = self.loading.prepare(batch, self.device, self._pads_labels())
        if self._run is not None and self._run.uint8_images and batch["img"].dtype == torch.uint8:
            return device_batch(batch, self.device)
        return super().preprocess_batch(batch)

    @override
    def plot_training_samples(self, batch: dict, ni: int) -> None:
        img = batch.get("img")
        if isinstance(img, torch.Tensor) and img.dtype == torch.uint8:
            batch = {**batch, "img": img.float() / 255}  # as ultralytics' preprocessing has them
        return super().plot_training_samples(batch, ni)

    def _pads_labels(self) -> bool:
        """Whether the training batches carry padded labels (a fused loss trains)."""
        return self.fused_loss and takes_fused_loss(unwrap_model(self.model))

    @override
    def save_model(self):
        """Ultralytics' checkpoint, with the fused optimizer's state in torch.optim's layout, written
        in the background (``checkpoints``), or by ultralytics where no snapshot can be taken."""
        if self.checkpoints.save(self, torch_layout=self.fused):
            return True
        if not self.fused:
            return super().save_model()
        optimizer = self.optimizer
        self.optimizer = TorchLayoutOptimizer(optimizer)
        try:
            return super().save_model()
        finally:
            self.optimizer = optimizer


__all__ = ["OPTIONS", "FusedTrainer"]
