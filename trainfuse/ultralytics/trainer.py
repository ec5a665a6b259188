"""FusedDetectionTrainer: ultralytics' DetectionTrainer with trainfuse's optimizer phase and loss.

Use it like any ultralytics trainer; every argument keeps its meaning::

    from ultralytics import YOLO
    from trainfuse.ultralytics import FusedDetectionTrainer

    YOLO("yolov5n.yaml").train(data="data.yaml", trainer=FusedDetectionTrainer)

What it changes, and nothing else (ultralytics itself is not patched):

- **Optimizer**: ultralytics builds its optimizer and param groups as always (every ``optimizer=``
  choice, ``auto`` included); an ``SGD``, ``Adam``, ``AdamW`` or ``MuSGD`` (what ``auto`` picks
  past 10,000 iterations) is then rebuilt over the very same groups (every key kept:
  ``param_group``, ``lr``, ``momentum``, ``betas``, ``use_muon``, decay; MuSGD's ``muon`` and
  ``sgd`` factors) as :class:`~trainfuse.optim.FusedSGD`, :class:`~trainfuse.optim.FusedAdam`,
  :class:`~trainfuse.optim.FusedAdamW` or :class:`~trainfuse.optim.FusedMuSGD`, clipping at
  ultralytics' norm of 10 inside the step. ``NAdam``, ``RAdam``, ``Adamax`` and ``RMSprop`` stay
  stock, and the log says why.
- **Warmup** writes ``lr`` and ``momentum`` into the groups as floats; the kernels read them from a
  device table refreshed by a non-blocking copy when they change (no recompile, no host sync).
- **optimizer_step**: ``scaler.step_and_update`` runs one statistics launch (the inf/NaN check,
  the gradient norm and GradScaler's scale update) and one update launch (unscale, clip, step,
  EMA of every param and buffer); ``zero_grad`` sets grads to None. Two launches in all (stock:
  several hundred on yolov5n).
- **EMA**: :class:`~trainfuse.optim.FusedEMA` replaces ``ModelEMA``, attached to the fused
  optimizer. Its semantics are ultralytics': one EMA update per ``optimizer_step``, also when
  GradScaler skips the step for an inf/NaN gradient (the EMA then moves toward the unchanged
  weights and the buffers, exactly as ``ModelEMA.update`` after a skipped ``scaler.step``).
- **GradScaler**: :class:`trainfuse.amp.GradScaler` replaces torch's, state included.
- **Casts** (AMP on CUDA): the weights become float16 (bfloat16 under ``amp="bf16"``) with float32
  masters in the optimizer, whose update writes both: autocast then casts no weight forward and no
  grad back (about 120 launches an iteration on yolov5n). See :mod:`trainfuse.ultralytics.casts`.
- **Loss**: :func:`_criterion` picks the detection loss the model trains with:
  :class:`~trainfuse.ultralytics.FusedDetectionLoss` (ultralytics' ``v8DetectionLoss`` without host
  syncs) or, for end-to-end heads (YOLO26, YOLOv10), :class:`~trainfuse.ultralytics.FusedE2ELoss`
  (``E2ELoss``'s two branches and its decaying weights), with the labels padded to a bucketed
  capacity on the CPU in ``preprocess_batch``, before ultralytics moves the batch to the GPU.
- **CUDA graphs** (``cuda_graphs=True``, the default where it is safe): the forward, the loss and
  the backward run from a CUDA graph per image shape and label capacity
  (:class:`~trainfuse.ultralytics.graphed.GraphedLoss`); the optimizer phase stays its two eager
  launches, and the grads are kept and zeroed inside the next replay instead of freed. The
  progress bar's losses are read back without a host sync (a few iterations late);
  each epoch's logged means are exact. Whatever the optimizer: a stock one (``NAdam``, ``RAdam``...)
  runs its own phase eagerly between replays. Off, with the reason logged, on CPU, with
  ``compile``, or without a fused loss. Choose with
  ``trainer=functools.partial(FusedDetectionTrainer, cuda_graphs=False)`` (under DDP with a
  subclass setting ``cuda_graphs = False``: the ranks rebuild the trainer from its class).
- **DDP** (``device="0,1"``, ultralytics' own launcher): each rank runs all of the above. With
  graphs, DDP's wrapper is dropped after ultralytics builds it: the replays backpropagate
  ultralytics' ``loss * world_size`` as the eager loop does and accumulate the micro-batches'
  grads in views of one flat float32 buffer, and one all-reduce averages them before each
  optimizer step (:class:`trainfuse.clients.FlatGrads`), where DDP all-reduces its buckets after
  every backward. Without graphs DDP's wrapper stays. The weights stay float32 under DDP (no
  casts), so the grads are reduced in float32 as stock reduces them.

Checkpoints stay stock: the optimizer state_dict has torch's layout (no masters), the EMA is a
plain float32 model saved as ultralytics saves it, so ``last.pt`` / ``best.pt`` load, validate,
predict and resume with stock ultralytics, and a stock checkpoint resumes with this trainer.
"""

from __future__ import annotations

from typing import Any

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
    swap_optimizer,
    why_not_swappable,
)
from trainfuse.optim import FusedEMA, FusedOptimizer
from trainfuse.ultralytics.casts import TorchLayoutOptimizer, cast_dtype
from trainfuse.ultralytics.e2e_loss import FusedE2ELoss, takes_fused_e2e_loss
from trainfuse.ultralytics.graphed import GraphedLoss
from trainfuse.ultralytics.loss import FusedDetectionLoss
from trainfuse.ultralytics.targets import PADDED_KEY, PadTargets, add_padded_targets

# ultralytics' optimizer_step clips the gradient norm at this value
CLIP_NORM = 10.0
_PREFIX = colorstr("trainfuse:")


def _takes_fused_loss(model: torch.nn.Module) -> bool:
    """Whether a fused loss implements ``model``'s: a plain DetectionModel, end-to-end (YOLO26,
    YOLOv10: :class:`FusedE2ELoss`) or not (:class:`FusedDetectionLoss`)."""
    if type(model) is not DetectionModel:
        return False
    return takes_fused_e2e_loss(model) or getattr(model.model[-1], "one2one_cv2", None) is None


def _criterion(model: torch.nn.Module) -> Any:
    """The detection loss :class:`FusedDetectionTrainer` installs on ``model``: the one place to
    switch it. :class:`~trainfuse.ultralytics.FusedE2ELoss` for end-to-end heads,
    :class:`~trainfuse.ultralytics.FusedDetectionLoss` for the others (:func:`_takes_fused_loss`),
    else ultralytics' own ``model.init_criterion()``."""
    if takes_fused_e2e_loss(model):
        return FusedE2ELoss(model)
    return FusedDetectionLoss(model) if _takes_fused_loss(model) else model.init_criterion()


def fused_optimizer(stock: torch.optim.Optimizer, max_grad_norm: float | None = CLIP_NORM
                    ) -> tuple[torch.optim.Optimizer | None, str]:
    """Rebuild ``stock`` (an optimizer ultralytics built) as its fused drop-in over the same groups.

    Args:
        stock: the optimizer; its param groups are reused with every key they carry.
        max_grad_norm: the global gradient norm the fused step clips to (None: no clipping).

    Returns:
        ``(fused optimizer, "")``, or ``(None, reason)`` when it stays stock
        (:func:`trainfuse.clients.why_not_swappable`: no fused counterpart, state already there...).
    """
    reason = why_not_swappable(stock, kernels=False, fresh=True)
    if reason is not None:
        return None, reason
    return swap_optimizer(stock, max_grad_norm=max_grad_norm), ""


def _keep_grads(set_to_none: bool = True) -> None:
    """``zero_grad`` of a stock optimizer while the graphs keep its grads (the next replay zeroes them)."""


def _check_task(args: Any) -> None:
    """Refuse a run of another task (segment, pose, obb, classify): their heads and losses are not
    fused, and a detection trainer would train them half-way."""
    if args.task not in (None, "detect"):
        raise ValueError(
            f"FusedDetectionTrainer trains detection models (task='detect'); this run's task is "
            f"{args.task!r} (model={args.model}). Its head and loss are not fused: train it with "
            "ultralytics' own trainer (leave out trainer=), or pick a detection model")


class FusedDetectionTrainer(DetectionTrainer):
    """``ultralytics.models.yolo.detect.DetectionTrainer`` with a fused optimizer phase (see the
    module docstring): ``YOLO("yolov5n.yaml").train(trainer=FusedDetectionTrainer, ...)``.

    Attributes:
        fused_loss: install :func:`_criterion`'s loss (a subclass may set False to train with
            ultralytics' own loss and fuse only the optimizer phase).
        fused_reason: empty when the optimizer is fused, else why it stayed stock.
        fuse_casts: under AMP on CUDA, keep 16-bit weights with float32 masters in the fused
            optimizer (a subclass may set False to keep float32 weights and autocast's casts).
        cuda_graphs: run forward, loss and backward from CUDA graphs where safe (the default);
            also a keyword of the constructor.
        graphs_reason: empty when the step runs from CUDA graphs, else why it runs eagerly.
        keeps_grads: True once the step runs from CUDA graphs: ``optimizer_step`` then leaves the
            grads in place for the next replay to zero (inside its graph) instead of freeing them.
        report: what the trainer changed and what it left stock, with why
            (:class:`trainfuse.clients.Row` s; each is also logged).
        graph_stats, graph_memory: after a graphed run, the step's
            :attr:`~trainfuse.graphs.CapturedStep.stats` and
            :meth:`~trainfuse.graphs.CapturedStep.memory_report` (None before).
    """

    fused_loss = True
    fused_reason = "the optimizer is not built yet"
    fuse_casts = True
    cuda_graphs = True
    graphs_reason = "training has not started"
    _pad_targets = False
    _casts: CastState | None = None
    _graphed: GraphedLoss | None = None
    _flat: FlatGrads | None = None
    keeps_grads = False
    graph_stats = graph_memory = None

    def __init__(self, cfg=DEFAULT_CFG, overrides: dict | None = None, *args, cuda_graphs: bool | None = None,
                 **kwargs):
        # before ultralytics checks the dataset, which fails for another task's data first
        _check_task(get_cfg(cfg, overrides))
        super().__init__(cfg, overrides, *args, **kwargs)
        _check_task(self.args)
        self.report = Report("FusedDetectionTrainer")
        if cuda_graphs is not None:
            if not isinstance(cuda_graphs, bool):
                raise TypeError(f"FusedDetectionTrainer: cuda_graphs must be True or False, "
                                f"got {cuda_graphs!r}")
            self.cuda_graphs = cuda_graphs
        # first in line, so that every other epoch-end callback sees the exact loss means; the
        # dict may be the YOLO object's, shared with its later trainers: once only
        for event, callback in _GRAPH_CALLBACKS.items():
            if callback not in self.callbacks[event]:
                self.callbacks[event].insert(0, callback)

    def train(self):
        """Ultralytics' ``train``; under DDP, a warning where ``cuda_graphs`` was given to the
        constructor (the ranks rebuild the trainer from its class and would not see it)."""
        if self.ddp and self.cuda_graphs != type(self).cuda_graphs:
            LOGGER.warning(f"{_PREFIX} cuda_graphs={self.cuda_graphs} does not reach the DDP ranks, which "
                           "rebuild the trainer from its class: use a subclass that sets cuda_graphs")
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
        fused (statistics with GradScaler's update, then the update with the EMA folded in), else
        ultralytics' own phase. With CUDA graphs, zero_grad is left to the next replay
        (``keeps_grads``). Under DDP with graphs, the accumulated grads are averaged over the ranks
        first (one all-reduce)."""
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
        if isinstance(self.scaler, GradScaler):
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
            old, model.criterion = getattr(model, "criterion", None), _criterion(model)
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
        self._setup_graphs()

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

    def _setup_graphs(self) -> None:
        if self._graphed is not None:
            self._graphed.detach()
            self._graphed = None
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
        self._graphed = GraphedLoss(model, self.scaler, grads=self._flat.grads if ddp else None,
                                    loss_factor=self.world_size if ddp else 1).attach()
        self.keeps_grads = True
        self._note("graphs", "cuda_graphs", ON, "forward, loss and backward replayed from CUDA graphs (one "
                   "per image shape and label capacity; each shape's first batch runs eagerly)")

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

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None):
        """Ultralytics' dataset; in training, its batches also carry the labels padded to their
        bucketed capacity (``add_padded_targets``, run by the loader's workers)."""
        dataset = super().build_dataset(img_path, mode, batch)
        if mode == "train" and self.fused_loss and _takes_fused_loss(unwrap_model(self.model)):
            dataset.collate_fn = PadTargets(dataset.collate_fn)
        return dataset

    def preprocess_batch(self, batch: dict) -> dict:
        """Pad the labels on the CPU where the loader did not, then ultralytics' preprocessing
        (which moves the padded labels to the device with the rest of the batch)."""
        if self._pad_targets and PADDED_KEY not in batch and batch["batch_idx"].device.type == "cpu":
            add_padded_targets(batch)
        return super().preprocess_batch(batch)

    def _load_checkpoint_state(self, ckpt):
        # the weights may change storage: the graphs are dropped and made anew after (and the
        # EMA's copy of the model must not carry them)
        graphed, self._graphed = self._graphed, None
        if graphed is not None:
            graphed.detach()
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
    if (graphed := _graphed(trainer)) is not None and (means := graphed.epoch_means()) is not None:
        trainer.tloss = means
        trainer.loss_items = graphed.last_items()


def _on_train_end(trainer) -> None:
    """Keep what the graphed step did (``graph_stats``, ``graph_memory``), give the model its own
    ``loss`` back and drop the graphs."""
    if (graphed := _graphed(trainer)) is not None:
        trainer.graph_stats, trainer.graph_memory = graphed.step.stats, graphed.step.memory_report()
        graphed.detach()
        trainer._graphed = None
    if isinstance(trainer, FusedDetectionTrainer) and trainer._flat is not None:
        trainer._flat.detach()  # the process group ends with training
        trainer._flat = None


_GRAPH_CALLBACKS = {"on_train_epoch_start": _on_train_epoch_start, "on_train_epoch_end": _on_train_epoch_end,
                    "on_train_end": _on_train_end}


__all__ = ["CLIP_NORM", "FusedDetectionTrainer", "PadTargets", "fused_optimizer"]
