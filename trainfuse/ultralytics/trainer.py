"""FusedDetectionTrainer: ultralytics' DetectionTrainer with trainfuse's optimizer phase and loss.

Use it like any ultralytics trainer; every argument keeps its meaning::

    from ultralytics import YOLO
    from trainfuse.ultralytics import FusedDetectionTrainer

    YOLO("yolov5n.yaml").train(data="data.yaml", trainer=FusedDetectionTrainer)

What it changes (ultralytics itself is not patched; docs/integrations.md has the details and where
results differ on purpose):

- **Optimizer**: ultralytics' ``SGD``, ``Adam``, ``AdamW`` or ``MuSGD`` (what ``auto`` picks past
  10,000 iterations) rebuilt over the very same param groups as its fused drop-in, clipping at
  ultralytics' norm of 10 inside the step; ``NAdam``, ``RAdam``, ``Adamax`` and ``RMSprop`` stay
  stock, and the log says why. Warmup's ``lr`` and ``momentum`` reach the kernels through a device
  table (no recompile, no host sync).
- **optimizer_step**: two launches (statistics with GradScaler's update, then unscale, clip, step
  and the EMA of every param and buffer); :class:`~trainfuse.optim.FusedEMA` replaces ``ModelEMA``
  with its semantics, :class:`trainfuse.amp.GradScaler` torch's GradScaler.
- **Casts** (AMP on CUDA, one GPU): 16-bit weights with float32 masters in the optimizer
  (:mod:`trainfuse.ultralytics.casts`).
- **Loss**: :class:`~trainfuse.ultralytics.FusedDetectionLoss` or, for end-to-end heads (YOLO26,
  YOLOv10), :class:`~trainfuse.ultralytics.FusedE2ELoss`, without host syncs, the labels padded on
  the CPU by the loader's workers.
- **CUDA graphs** (``cuda_graphs=True``, the default where it is safe): forward, loss and backward
  replayed per image shape and label capacity (:class:`~trainfuse.ultralytics.graphed.GraphedLoss`),
  the grads kept and zeroed inside the next replay; the fused phase of SGD, Adam and AdamW under AMP,
  once steady, inside the graph of each iteration the loop steps after (under DDP, a graph of its
  own: :class:`~trainfuse.graphs.GraphedOptimizerStep`).
  Off on CPU, with ``compile``, or without a fused loss; choose with
  ``trainer=functools.partial(FusedDetectionTrainer, cuda_graphs=False)`` (under DDP, a subclass
  setting ``cuda_graphs = False``).
- **Input side** (CUDA): where the images are read from disk every epoch (``gpu_augment``, on by
  default unless ``cache="ram"``), the JPEG decoding, random warp, HSV jitter and flips of the
  training batches on the GPU, with ultralytics' own random draws
  (:mod:`trainfuse.ultralytics.loading`); the first convolution on the space-to-depth image
  (:mod:`trainfuse.nn.stem`, ``fold_stem``); the batches copied to the GPU one ahead on a side
  stream (:class:`~trainfuse.ultralytics.prefetch.DevicePrefetcher`, ``prefetch``).
- **DDP** (``device="0,1"``): each rank runs all of the above; with graphs, DDP's wrapper gives way to
  one all-reduce of a flat float32 buffer before each optimizer step
  (:class:`trainfuse.clients.FlatGrads`). The weights stay float32 under DDP.

Checkpoints stay stock: the optimizer state_dict has torch's layout (no masters), the EMA is a
plain float32 model saved as ultralytics saves it, so ``last.pt`` / ``best.pt`` load, validate,
predict and resume with stock ultralytics, and a stock checkpoint resumes with this trainer.
"""

from __future__ import annotations

import torch
from ultralytics.cfg import get_cfg
from ultralytics.models.yolo.detect import DetectionTrainer
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils import DEFAULT_CFG, LOGGER, colorstr
from ultralytics.utils.torch_utils import ModelEMA, unwrap_model

from trainfuse.amp import GradScaler
from trainfuse.clients import (
    OFF,
    ON,
    SKIPPED,
    SWAPPED,
    CastState,
    FlatGrads,
    Report,
    fused_scaler,
)
from trainfuse.graphs import GraphedOptimizerStep
from trainfuse.losses.detection.targets import PadTargets
from trainfuse.nn import stem
from trainfuse.optim import FusedAdam, FusedEMA, FusedOptimizer, FusedSGD
from trainfuse.ultralytics.casts import TorchLayoutOptimizer, cast_dtype
from trainfuse.ultralytics.choices import CLIP_NORM, check_task, criterion, fused_optimizer
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss
from trainfuse.ultralytics.graphed import GraphedLoss
from trainfuse.ultralytics.loading import BatchLoading
from trainfuse.ultralytics.loss import FusedDetectionLoss

_PREFIX = colorstr("trainfuse:")
GRAPHED_PHASES = (FusedSGD, FusedAdam)  # their phase, graph-safe, replays from one graph (AdamW: an Adam)


def _keep_grads(set_to_none: bool = True) -> None:
    """``zero_grad`` of a stock optimizer while the graphs keep its grads (the next replay zeroes them)."""


class FusedDetectionTrainer(BatchLoading, DetectionTrainer):
    """``ultralytics.models.yolo.detect.DetectionTrainer`` with a fused optimizer phase (see the
    module docstring): ``YOLO("yolov5n.yaml").train(trainer=FusedDetectionTrainer, ...)``.

    Attributes:
        fused_loss: install :func:`~trainfuse.ultralytics.choices.criterion`'s loss (a subclass may
            set False to train with ultralytics' own loss and fuse only the optimizer phase).
        fused_reason: empty when the optimizer is fused, else why it stayed stock.
        fuse_casts: under AMP on CUDA, keep 16-bit weights with float32 masters in the fused
            optimizer (a subclass may set False to keep float32 weights and autocast's casts).
        cuda_graphs: run forward, loss and backward from CUDA graphs where safe (the default);
            also a keyword of the constructor.
        graphs_reason: empty when the step runs from CUDA graphs, else why it runs eagerly.
        fold_stem: on CUDA, compute the first convolution on the space-to-depth image
            (:mod:`trainfuse.nn.stem`; a subclass may set False).
        gpu_augment, augment_reason, prefetch: the training batches' augmentation on the GPU and
            their copies one batch ahead (:class:`~trainfuse.ultralytics.loading.BatchLoading`).
        keeps_grads: True once the step runs from CUDA graphs: ``optimizer_step`` then leaves the
            grads in place for the next replay to zero (inside its graph) instead of freeing them.
        report: what the trainer changed and what it left stock, with why
            (:class:`trainfuse.clients.Row` s; each is also logged).
        graph_stats, graph_memory: after a graphed run, the step's
            :attr:`~trainfuse.graphs.CapturedStep.stats` and
            :meth:`~trainfuse.graphs.CapturedStep.memory_report` (None before).
        phase_stats: after a graphed run whose optimizer phase was graphed, its eager calls,
            captures, replays and runs inside the step's graphs (``folded``)
            (:class:`~trainfuse.graphs.GraphedOptimizerStep`; None before).
    """

    fused_loss = True
    fused_reason = "the optimizer is not built yet"
    fuse_casts = True
    cuda_graphs = True
    graphs_reason = "training has not started"
    _pad_targets = False
    _casts: CastState | None = None
    _graphed: GraphedLoss | None = None
    _phase: GraphedOptimizerStep | None = None
    _stem: torch.nn.Module | None = None
    fold_stem = True
    _flat: FlatGrads | None = None
    keeps_grads = False
    graph_stats = graph_memory = phase_stats = None

    def __init__(self, cfg=DEFAULT_CFG, overrides: dict | None = None, *args, cuda_graphs: bool | None = None,
                 gpu_augment: bool | None = None, **kwargs):
        if gpu_augment is not None and not isinstance(gpu_augment, bool):
            raise TypeError(f"FusedDetectionTrainer: gpu_augment must be True, False or None (the default: "
                            f"on for CUDA where the images are read from disk), got {gpu_augment!r}")
        # before ultralytics checks the dataset, which fails for another task's data first
        check_task(get_cfg(cfg, overrides))
        super().__init__(cfg, overrides, *args, **kwargs)
        check_task(self.args)
        self.report = Report("FusedDetectionTrainer")
        if cuda_graphs is not None:
            if not isinstance(cuda_graphs, bool):
                raise TypeError(f"FusedDetectionTrainer: cuda_graphs must be True or False, "
                                f"got {cuda_graphs!r}")
            self.cuda_graphs = cuda_graphs
        if gpu_augment is not None:
            self.gpu_augment = gpu_augment
        # first in line, so that every other epoch-end callback sees the exact loss means; the
        # dict may be the YOLO object's, shared with its later trainers: once only
        for event, callback in _GRAPH_CALLBACKS.items():
            if callback not in self.callbacks[event]:
                self.callbacks[event].insert(0, callback)

    def train(self):
        """Ultralytics' ``train``; under DDP, a warning where ``cuda_graphs`` or ``gpu_augment`` was
        given to the constructor (the ranks rebuild the trainer from its class and would not see it)."""
        for name in ("cuda_graphs", "gpu_augment"):
            if self.ddp and getattr(self, name) != getattr(type(self), name):
                LOGGER.warning(f"{_PREFIX} {name}={getattr(self, name)} does not reach the DDP ranks, which "
                               f"rebuild the trainer from its class: use a subclass that sets {name}")
        return super().train()

    # ---- optimizer -------------------------------------------------------------------------------
    def build_optimizer(self, model, name="auto", lr=0.001, momentum=0.9, decay=1e-5, iterations=1e5):
        """Ultralytics' optimizer and param groups, rebuilt as a fused optimizer where one exists
        (same arguments and return as ``BaseTrainer.build_optimizer``)."""
        stock = super().build_optimizer(model, name, lr, momentum, decay, iterations)
        fused, self.fused_reason = fused_optimizer(stock)
        if fused is None:
            self._note("optimizer", type(stock).__name__, SKIPPED,
                       f"optimizer stays stock {type(stock).__name__}: {self.fused_reason}")
            return stock
        self._note("optimizer", type(stock).__name__, SWAPPED,
                   f"{type(fused).__name__} over ultralytics' {len(fused.param_groups)} param groups, "
                   f"gradient norm clipped at {CLIP_NORM:g} inside the step")
        return fused

    @property
    def fused(self) -> bool:
        """Whether the optimizer phase runs fused (a trainfuse optimizer was built)."""
        return isinstance(getattr(self, "optimizer", None), FusedOptimizer)

    def optimizer_step(self):
        """Unscale, clip at 10, step, EMA update, scale update and zero_grad: two launches when
        fused (statistics with GradScaler's update, then the update with the EMA folded in; with
        graphs, one replay of them), else ultralytics' own phase. With CUDA graphs, zero_grad is
        left to the next replay (``keeps_grads``). Under DDP with graphs, the accumulated grads are
        averaged over the ranks first (one all-reduce)."""
        if self._flat is not None:
            self._flat.all_reduce(average=True)  # of the grads of loss * world_size, as DDP averages
        if not self.fused:
            if not self.keeps_grads or self._graphed is None:  # no replay follows (training ended)
                return super().optimizer_step()
            # ultralytics' own phase as its version runs it, with the grads kept for the replay
            self.optimizer.zero_grad = _keep_grads  # this call only: the instance's, over the class's
            try:
                super().optimizer_step()
            finally:
                del self.optimizer.zero_grad
            self._graphed.zero_first = True
            return
        if self._graphed is not None and self._graphed.optimizer_stepped():
            if self.ema:  # this iteration's graph ran the phase after its backward, then zeroed the grads
                self.ema.update(self.model)  # counts nothing while attached
            return
        if self._phase is not None:
            self._phase()  # replayed from its graph once steady
        elif isinstance(self.scaler, GradScaler):
            self.scaler.step_and_update(self.optimizer)
        else:  # a scaler of another kind (NPU) keeps its own two calls
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if not self.keeps_grads:
            self.optimizer.zero_grad()
        elif self._graphed is not None:  # the graphs accumulate into the grads they captured:
            self._graphed.zero_first = True  # the next replay zeroes them
        if self.ema:
            self.ema.update(self.model)  # counts nothing while attached: the step did this update

    # ---- setup: scaler, EMA, loss --------------------------------------------------------------
    def _note(self, kind: str, name: str, action: str, detail: str) -> None:
        """One row of :attr:`report`, logged as it is made."""
        self.report.add(kind, name, action, detail)
        LOGGER.info(f"{_PREFIX} {detail}")

    def _setup_train(self):
        self.report.clear()
        super()._setup_train()
        self._install_scaler()
        self._install_ema()
        model = unwrap_model(self.model)
        if self.fused_loss and isinstance(model, DetectionModel):  # segment, pose, ... keep their own
            old, model.criterion = getattr(model, "criterion", None), criterion(model)
            if isinstance(model.criterion, FusedE2ELoss) and old is not None:
                model.criterion.copy_schedule(old)  # a resume set ultralytics' E2ELoss to its epoch
            self._pad_targets = isinstance(model.criterion, (FusedDetectionLoss, FusedE2ELoss))
            if self._pad_targets:
                self._note("loss", type(model).__name__, SWAPPED, f"{type(model.criterion).__name__}, "
                           "labels padded on the CPU (no host sync in the loss)")
            else:
                self._note("loss", type(model).__name__, SKIPPED,
                           f"ultralytics' own {type(model.criterion).__name__}: the fused losses implement "
                           "v8DetectionLoss and E2ELoss of plain detection models")
        self._apply_casts()
        self._fold_stem()
        self._setup_graphs()

    def _fold_stem(self) -> None:
        """The first convolution (3 channels, stride 2) computed on the space-to-depth input, on
        CUDA (``fold_stem``): :mod:`trainfuse.nn.stem`."""
        if not self.fold_stem or self.device.type != "cuda" or self.args.compile:  # compile: its own kernels
            return
        first = unwrap_model(self.model).model[0]
        conv = getattr(first, "conv", first)
        if conv is self._stem or stem.install(conv):
            self._stem = conv
            self._note("stem", type(first).__name__, ON, f"first convolution ({conv.in_channels} channels, "
                       f"kernel {conv.kernel_size[0]}, stride 2) computed as a stride-1 convolution on the "
                       "space-to-depth image (same function, tensor-core kernels)")

    def _is_ddp_rank(self) -> bool:
        """Whether this is one rank of a DDP run."""
        return self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    def _graphs_unsafe(self) -> str:
        """Why the step cannot run from CUDA graphs here ("" when it can)."""
        if not self.cuda_graphs:
            return "cuda_graphs=False"
        if self.device.type != "cuda":
            return f"the device is {self.device.type}, not CUDA"
        if self.args.compile:
            return "compile is on"
        if not isinstance(self.scaler, GradScaler):
            return f"the scaler is {type(self.scaler).__name__}, not torch's GradScaler"
        if not self._pad_targets:
            return "the model trains with ultralytics' own loss, which syncs with the host"
        return ""

    def _drop_graphs(self) -> None:
        """Drop the step's graphs and the optimizer phase's (the optimizer steps eagerly again)."""
        if self._graphed is not None:
            self._graphed.detach()
            self._graphed = None
        if self._phase is not None:
            self._phase.close()
            self._phase = None

    def _setup_graphs(self) -> None:
        self._drop_graphs()
        if self._flat is not None:
            self._flat.detach()
            self._flat = None
        self.graphs_reason = self._graphs_unsafe()
        if self.graphs_reason:
            self._note("graphs", "cuda_graphs", OFF, f"no CUDA graphs: {self.graphs_reason}")
            return
        model = unwrap_model(self.model)
        if self._is_ddp_rank():
            # the replays accumulate the micro-batches' grads in place; one all-reduce of one flat
            # buffer before each optimizer step replaces DDP's hooks and per-backward buckets
            self.model = model  # the DDP wrapper goes, and its reducer's hooks with it
            self._flat = FlatGrads(model.parameters()).attach()
            sizes = ", ".join(f"{b.numel() / 1e6:.1f}M {str(b.dtype).replace('torch.', '')}"
                              for b in self._flat.buffers.values())
            self._note("ddp", "DistributedDataParallel", SWAPPED,
                       f"gradients all-reduced once per optimizer step as one flat buffer ({sizes}) "
                       f"across {self.world_size} ranks, after the replays (DDP's reducer replaced)")
        ddp = self._flat is not None  # ultralytics' loss * world_size, averaged: DDP's arithmetic
        paced = self.jpeg_decoder is not None  # beside the GPU decoding's thread (GraphedLoss)
        self._graphed = GraphedLoss(model, self.scaler, grads=self._flat.grads if ddp else None,
                                    loss_factor=self.world_size if ddp else 1, paced=paced).attach()
        self.keeps_grads = True
        self._note("graphs", "cuda_graphs", ON, "forward, loss and backward replayed from CUDA graphs (one "
                   "per image shape and label capacity; each shape's first batch runs eagerly)"
                   + ("; paced: each replay waits for the last, beside the GPU decoding" if paced else ""))
        why_not = self._phase_unsafe()
        if why_not:
            self._note("phase", "optimizer phase", OFF, f"optimizer phase eager: {why_not}")
            return
        self._phase = GraphedOptimizerStep(self.optimizer, self.scaler)
        if ddp:  # the all-reduce comes between the backward and the phase
            where = "replayed from one CUDA graph of its own"
        else:
            where = "run inside the graph of each iteration the loop steps after"
            self._graphed.fold_phase(self._phase, lambda: self.accumulate)
        self._note("phase", "optimizer phase", ON, f"optimizer phase (unscale, inf check, clip, step, EMA, "
                   f"scale update) {where}, after its first steady steps; lr, momentum and the EMA weight "
                   "written to the device before")

    def _phase_unsafe(self) -> str:
        """Why the optimizer phase cannot replay from a graph ("" when it can)."""
        if not self.fused:
            return f"the optimizer is stock {type(self.optimizer).__name__}"
        if not isinstance(self.optimizer, GRAPHED_PHASES):
            return f"{type(self.optimizer).__name__}'s phase is not graph-safe (Muon's steps)"
        if not self.scaler.is_enabled():
            return "AMP is off (GradScaler disabled)"
        return ""

    def _apply_casts(self) -> None:
        """16-bit weights with float32 masters in the fused optimizer (AMP on CUDA only)."""
        dtype = cast_dtype(self) if self.fuse_casts else None
        if dtype is None:
            return
        if self.world_size > 1:
            self._note("casts", str(dtype).replace("torch.", ""), SKIPPED, "weights stay float32 under DDP: "
                       "the gradients are all-reduced in float32, as stock DDP reduces them")
            return
        self._casts = CastState(unwrap_model(self.model), self.optimizer, dtype)
        self._note("casts", str(dtype).replace("torch.", ""), ON,
                   f"{len(self._casts.params)} weights {str(dtype).replace('torch.', '')} with "
                   "float32 masters in the optimizer: autocast casts no weight (BatchNorm stays float32)")

    def save_model(self):
        """Ultralytics' checkpoint, with the fused optimizer's state in torch.optim's layout."""
        if not self.fused:
            return super().save_model()
        optimizer = self.optimizer
        self.optimizer = TorchLayoutOptimizer(optimizer)
        try:
            return super().save_model()
        finally:
            self.optimizer = optimizer

    def _load_checkpoint_state(self, ckpt):
        # the weights may change storage: the graphs are dropped and made anew after (and the
        # EMA's copy of the model must not carry them)
        graphed = self._graphed
        self._drop_graphs()
        # resume and NaN recovery load the EMA into a fresh ModelEMA: make it fused again. NaN
        # recovery runs mid-training, on cast weights: float32 again first (the EMA copies the
        # model; the optimizer state loaded has no masters), cast again after
        casts, self._casts = self._casts, None
        if casts is not None:
            casts.restore_from_weights()
        super()._load_checkpoint_state(ckpt)
        if getattr(self, "scaler", None) is not None:
            self._install_scaler()
        self._install_ema()
        if casts is not None:
            self._apply_casts()
        if graphed is not None:
            self._setup_graphs()

    def _install_scaler(self) -> None:
        """Replace torch's GradScaler by trainfuse's (same settings and state)."""
        # the device string ultralytics gives its own scaler; an NPU scaler, or ours, stays
        new = fused_scaler(self.scaler, "xpu" if self.device.type == "xpu" else "cuda")
        if new is not None:
            self.scaler = new

    def _install_ema(self) -> None:
        """Replace the ModelEMA by a FusedEMA with its weights and count, attached to the fused
        optimizer."""
        old = getattr(self, "ema", None)
        if not isinstance(old, ModelEMA):
            return
        ema = FusedEMA(self.model, updates=old.updates)
        ema.ema.load_state_dict(old.ema.state_dict())
        ema.enabled = old.enabled
        self.ema = ema
        if self.fused:
            self.optimizer.attach_ema(ema)


def _graphed(trainer) -> GraphedLoss | None:
    return trainer._graphed if isinstance(trainer, FusedDetectionTrainer) else None


def _on_train_epoch_start(trainer) -> None:
    """Restart the graphed step's per-epoch loss sums."""
    if (graphed := _graphed(trainer)) is not None:
        graphed.readout.start_epoch()


def _on_train_epoch_end(trainer) -> None:
    """Put the exact per-epoch loss means in ``trainer.tloss`` (what the epoch logs), and the last
    iteration's loss items, on the GPU as ultralytics' validator expects them, in
    ``trainer.loss_items``."""
    if (graphed := _graphed(trainer)) is not None:
        graphed.settle()
    if graphed is not None and (means := graphed.epoch_means()) is not None:
        trainer.tloss = means
        trainer.loss_items = graphed.last_items()


def _on_train_end(trainer) -> None:
    """Keep what the graphed step did (``graph_stats``, ``graph_memory``), give the model its own
    ``loss`` back and drop the graphs."""
    if (graphed := _graphed(trainer)) is not None:
        trainer.graph_stats, trainer.graph_memory = graphed.step.stats, graphed.step.memory_report()
        if (phase := trainer._phase) is not None:
            trainer.phase_stats = {"eager": phase.eager, "captures": phase.captures, "replays": phase.replays,
                                   "folded": phase.folded}
        trainer._drop_graphs()
    if isinstance(trainer, FusedDetectionTrainer) and trainer._stem is not None:
        stem.uninstall(trainer._stem)  # the model computes its stem as before
        trainer._stem = None
    if isinstance(trainer, FusedDetectionTrainer) and trainer._flat is not None:
        trainer._flat.detach()  # the process group ends with training
        trainer._flat = None


_GRAPH_CALLBACKS = {"on_train_epoch_start": _on_train_epoch_start, "on_train_epoch_end": _on_train_epoch_end,
                    "on_train_end": _on_train_end}


__all__ = ["CLIP_NORM", "FusedDetectionTrainer", "PadTargets", "fused_optimizer"]
