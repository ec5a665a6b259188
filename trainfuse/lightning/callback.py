"""FusedTraining: trainfuse's kernels in a Lightning run, switched on by one callback."""

from __future__ import annotations

from typing import Any

import torch

import trainfuse
from trainfuse.graphs import GraphedModule, StepStats
from trainfuse.lightning import _compat, graphs
from trainfuse.lightning.checkpoint import plain_checkpoint
from trainfuse.lightning.ema import WeightEMA
from trainfuse.lightning.modules import fuse_chains, fuse_losses
from trainfuse.lightning.optimizers import repoint_schedulers, swap_optimizer, why_not_swappable
from trainfuse.lightning.precision import PRECISIONS, CastState, precision_of, restore_scaler, swap_scaler
from trainfuse.lightning.report import OFF, ON, SKIPPED, SWAPPED, Report


def _log_step(trainer: Any) -> bool:
    """Whether the Trainer writes this step's logs (its ``log_every_n_steps`` cadence, as its
    logger connector decides it, read from public attributes; automatic optimization steps one
    optimizer a batch, so ``global_step`` after the step is the batch count it uses)."""
    every = trainer.log_every_n_steps
    if trainer.fast_dev_run:
        return True
    return bool(every) and (trainer.global_step % every == 0 or trainer.should_stop)


def _kernels_on(device: torch.device) -> bool:
    """Whether the fused optimizers run their Triton kernels for tensors on ``device``."""
    name = trainfuse.backend()
    return name == "triton" or (name == "auto" and device.type == "cuda")


class FusedTraining(*_compat.callback_bases()):
    """Runs a Lightning fit on trainfuse's fused kernels.

    At fit start (after Lightning restored a checkpoint's optimizer when ``ckpt_path=`` is given)
    it swaps ``torch.optim.AdamW``/``Adam``/``SGD`` for FusedAdamW/FusedAdam/FusedSGD (same param
    groups, state and schedulers), folds ``Trainer(gradient_clip_val=...)`` into their step (by
    norm: ``max_grad_norm``; by value: ``max_grad_value``), under 16-mixed/bf16-mixed makes the
    weights 16-bit with float32 masters in the optimizer (:func:`trainfuse.amp.fuse_casts`), swaps
    Linear/activation Sequentials for FusedMLP and ``nn.BCEWithLogitsLoss`` for the fused loss,
    and keeps an EMA inside the optimizer step.
    Checkpoints stay plain (float32 weights, torch.optim state layout). Every change, and every
    thing it left alone with the reason, is a row of :attr:`report`, printed on rank zero.

    Args:
        fuse_casts: under 16-mixed/bf16-mixed, 16-bit weights with float32 masters (the optimizer
            writes the weights the forward reads; autocast no longer re-casts them at each use).
        ema_decay: keep an EMA of the weights and buffers with this decay (Lightning's
            EMAWeightAveraging schedule: the first update copies); validation and test run on it.
            None: no EMA.
        mlp: swap Linear/activation ``nn.Sequential`` chains for ``trainfuse.nn.FusedMLP``.
        losses: swap ``nn.BCEWithLogitsLoss`` modules for ``trainfuse.losses.BCEWithLogitsLoss``.
        strict: raise :class:`trainfuse.lightning.SkipError` instead of skipping anything.
        log_grad_norm: log the pre-clip gradient norm as ``grad_norm`` (a device tensor, no sync) on
            the steps where the Trainer writes its logs (every ``log_every_n_steps``): a
            ``self.log`` call costs more host time than the whole fused step
            when clipping by norm runs in the step.
        verbose: print the report table on rank zero at fit start.
        cuda_graphs: replay the model's forward and backward from CUDA graphs, one pair per input
            shape (the first batch of a shape runs eagerly, the second is captured): the
            LightningModule's ``forward`` when it defines one, and each direct child module with
            trainable params that ``training_step`` calls. The loss, ``self.log``, hooks and the
            optimizer step run eagerly as before. For static shapes and forwards whose Python
            does the same every step (a replay repeats what the forward decided at capture); a
            forward that syncs with the host runs eagerly, with the reason in
            :attr:`graph_reasons`. Off on CPU and under DDP.

    Example::

        trainer = Trainer(precision="bf16-mixed", gradient_clip_val=1.0,
                          callbacks=[FusedTraining(ema_decay=0.999)])
        trainer.fit(model)
    """

    def __init__(self, *, fuse_casts: bool = True, ema_decay: float | None = None, mlp: bool = True,
                 losses: bool = True, strict: bool = False, log_grad_norm: bool = True,
                 verbose: bool = True, cuda_graphs: bool = False) -> None:
        for name, value in (("fuse_casts", fuse_casts), ("mlp", mlp), ("losses", losses), ("strict", strict),
                            ("log_grad_norm", log_grad_norm), ("verbose", verbose),
                            ("cuda_graphs", cuda_graphs)):
            if not isinstance(value, bool):
                raise TypeError(f"FusedTraining: {name} must be a bool, got {value!r}")
        if ema_decay is not None:
            number = isinstance(ema_decay, (int, float)) and not isinstance(ema_decay, bool)
            if not number or not 0.0 < ema_decay < 1.0:
                raise ValueError(f"FusedTraining: ema_decay must be a number in (0, 1) or None, "
                                 f"got {ema_decay!r}")
            ema_decay = float(ema_decay)
        self.fuse_casts = fuse_casts
        self.ema_decay = ema_decay
        self.mlp = mlp
        self.losses = losses
        self.strict = strict
        self.log_grad_norm = log_grad_norm
        self.verbose = verbose
        self.cuda_graphs = cuda_graphs
        self.report = Report(strict)
        self._graphs: dict[str, GraphedModule] = {}
        self._ema: WeightEMA | None = None
        self._ema_stash: dict[str, Any] | None = None
        self._reset()

    def _reset(self) -> None:
        self._applied = False
        self._deferred = False
        self._casts: CastState | None = None
        self._saved_clip: tuple[Any, Any] | None = None
        self._norm_optimizer: torch.optim.Optimizer | None = None
        self._old_scaler = None
        self._ema_steps = False  # the EMA is updated after the step, not inside it
        self._last_step = 0

    @property
    def graph_stats(self) -> dict[str, StepStats]:
        """Per graphed module (``"forward"``: the LightningModule's own): its eager calls, replays,
        captures, failed captures and evictions, from the last fit (kept after it ends)."""
        return {name: g.stats for name, g in self._graphs.items()}

    @property
    def graph_reasons(self) -> dict[str, dict]:
        """Per graphed module, the input keys that ran eagerly because of a host sync or a failed
        capture, with why."""
        return {name: g.reasons for name, g in self._graphs.items() if g.reasons}

    # ---- when it acts ----------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        averaging = _compat.weight_averaging_callbacks(trainer.callbacks)
        if averaging and self.ema_decay is not None:
            raise ValueError(
                f"FusedTraining(ema_decay={self.ema_decay}) and {type(averaging[0]).__name__} both keep an "
                f"average of the weights: remove {type(averaging[0]).__name__} (FusedTraining's EMA follows "
                "its schedule inside the optimizer step) or drop ema_decay")
        self._reset()
        self._graphs = {}
        self.report.clear()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # with ckpt_path, Lightning loads the optimizer state after this hook: the swap then waits
        # for on_train_start and carries the restored state over
        if trainer.ckpt_path is not None:
            self._deferred = True
            return
        self._apply(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._deferred and not self._applied:
            self._apply(trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not self._applied:
            return
        graphs.uninstall(self._graphs)  # before the casts change the params' storage
        if self._ema is not None:
            self._ema.swap_out(pl_module)
        if self._casts is not None:
            self._casts.restore()
        if self._saved_clip is not None:
            trainer.gradient_clip_val, trainer.gradient_clip_algorithm = self._saved_clip
        if self._old_scaler is not None:
            restore_scaler(trainer.precision_plugin, self._old_scaler)
        self._reset()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        graphs.uninstall(self._graphs)  # the module's own forward back, whatever happens next

    # ---- the changes -----------------------------------------------------------------------------
    def _apply(self, trainer: Any, pl_module: Any) -> None:
        self._applied = True
        report = self.report
        strategy = trainer.strategy
        device = strategy.root_device
        kernels = _kernels_on(device)
        setting = f"TRAINFUSE_BACKEND={trainfuse.backend()}"
        if kernels:
            report.add("backend", str(device), ON, f"Triton kernels ({setting})")
        elif not torch.cuda.is_available():
            report.add("backend", str(device), ON, "no GPU: torch path (torch.optim's math, same results)")
        else:
            report.add("backend", str(device), ON, f"torch path for {device.type} tensors ({setting})")
        precision = precision_of(trainer)
        if precision not in PRECISIONS:
            report.add("precision", f"precision={precision!r}", SKIPPED,
                       f"FusedTraining takes precision {', '.join(map(repr, PRECISIONS))}: nothing changed")
            return self._print(trainer)
        kind = _compat.strategy_kind(strategy)
        if kind not in ("single", "ddp"):
            report.add("strategy", kind, SKIPPED, "FusedTraining acts under single-device and DDP strategies "
                       "(sharded or engine-managed optimizers): nothing changed")
            return self._print(trainer)
        averaging = _compat.weight_averaging_callbacks(trainer.callbacks)

        if self.mlp:
            if fuse_chains(pl_module, report) == 0 and not any(r.kind == "mlp" for r in report):
                report.add("mlp", "-", OFF, "no nn.Sequential of Linear + activation in the module")
        if self.losses:
            if fuse_losses(pl_module, report) == 0 and not any(r.kind == "loss" for r in report):
                report.add("loss", "-", OFF, "no nn.BCEWithLogitsLoss module")

        clip_val = trainer.gradient_clip_val
        clip = float(clip_val) if clip_val is not None and clip_val > 0 else None
        algorithm = trainer.gradient_clip_algorithm
        algorithm = getattr(algorithm, "value", algorithm) or "norm"
        by_norm = algorithm == "norm"  # the fused step clips by norm or by value (kernels and torch path)
        swapped = self._swap_optimizers(trainer, pl_module, kernels, clip if by_norm else None,
                                        None if by_norm else clip)
        all_swapped = bool(swapped) and len(swapped) == len(strategy.optimizers)
        self._set_clipping(trainer, clip, algorithm, all_swapped, by_norm)

        if self.ema_decay is not None:  # before the casts: the EMA copies the float32 weights
            self._start_ema(pl_module, swapped, all_swapped)
        else:
            report.add("ema", "-", OFF, "ema_decay=None")
        self._set_casts(pl_module, precision, kind, kernels, swapped, all_swapped, averaging)
        if precision == "16-mixed" and swapped:
            self._old_scaler = swap_scaler(trainer.precision_plugin)
            if self._old_scaler is not None:
                report.add("scaler", "GradScaler", SWAPPED, "trainfuse.amp.GradScaler: the inf check is "
                           "the step's statistics pass; unscale and inf skip run in the step, no host sync")
        self._start_graphs(pl_module, kind, device)
        self._print(trainer)

    def _swap_optimizers(self, trainer: Any, pl_module: Any, kernels: bool, max_norm: float | None,
                         max_value: float | None) -> list:
        strategy = trainer.strategy
        manual = not pl_module.automatic_optimization
        own_clipping = _compat.is_overridden("configure_gradient_clipping", pl_module)
        result, swapped = [], []
        for i, opt in enumerate(strategy.optimizers):
            name = f"optimizer {i} ({type(opt).__name__})"
            if manual:
                reason = ("manual optimization: training_step steps and clips it through Lightning, which "
                          "refuses to clip optimizers that unscale inside their step")
            elif own_clipping:
                reason = ("configure_gradient_clipping is overridden: it clips through Lightning, which "
                          "refuses to clip optimizers that unscale inside their step")
            else:
                reason = why_not_swappable(opt, kernels)
            if reason is not None:
                self.report.add("optimizer", name, SKIPPED, reason)
                result.append(opt)
                continue
            new = swap_optimizer(opt, max_norm, max_value)
            moved = repoint_schedulers(strategy.lr_scheduler_configs, opt, new)
            detail = f"{type(new).__name__}: one multi-tensor launch per step"
            if moved:
                detail += f"; {moved} LR scheduler{'s' if moved > 1 else ''} re-pointed"
            self.report.add("optimizer", name, SWAPPED, detail)
            result.append(new)
            swapped.append(new)
        if swapped:
            strategy.optimizers = result  # rebuilds the LightningOptimizer wrappers the loop steps
        return swapped

    def _set_clipping(self, trainer: Any, clip: float | None, algorithm: str, all_swapped: bool,
                      by_norm: bool) -> None:
        name = f"gradient_clip_val={trainer.gradient_clip_val}, algorithm={algorithm}"
        if clip is None:
            self.report.add("clipping", "gradient_clip_val", OFF, "not set")
            return
        if not all_swapped:
            self.report.add("clipping", name, SKIPPED, "an optimizer was not swapped: Lightning clips as "
                            "before")
            return
        self._saved_clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        trainer.gradient_clip_val = None  # Lightning's clipping refuses fused optimizers; ours runs instead
        off = "Trainer clipping off for the run"
        if by_norm:
            self._norm_optimizer = trainer.strategy.optimizers[0]
            self.report.add("clipping", name, ON, "by norm inside the fused step (statistics pass + update, "
                            f"no host sync); pre-clip norm logged as grad_norm; {off}")
        else:
            self.report.add("clipping", name, ON, "by value inside the fused step (the update clamps the "
                            f"unscaled grads: no extra launch, no host sync); {off}")

    def _start_ema(self, pl_module: Any, swapped: list, all_swapped: bool) -> None:
        ema = WeightEMA(pl_module, self.ema_decay)
        if self._ema_stash is not None:
            ema.load_state_dict(self._ema_stash)
            self._ema_stash = None
        self._ema = ema
        n = len(ema.pairs)
        if len(swapped) == 1 and all_swapped:
            swapped[0].attach_ema(ema.fused)
            self.report.add("ema", f"decay={self.ema_decay}", ON, f"{n} tensors averaged inside the "
                            "optimizer step; validation/test run on the EMA; saved in the checkpoint")
        else:
            self._ema_steps = True
            self.report.add("ema", f"decay={self.ema_decay}", ON, f"{n} tensors averaged in one launch "
                            "after each optimizer step (not one swapped optimizer to fold it into); "
                            "validation/test run on the EMA; saved in the checkpoint")

    def _set_casts(self, pl_module, precision, kind, kernels, swapped, all_swapped, averaging) -> None:
        dtype = PRECISIONS[precision]
        if dtype is None:
            self.report.add("casts", precision, OFF, "32-true: nothing is cast")
            return
        if not self.fuse_casts:
            self.report.add("casts", precision, OFF, "fuse_casts=False: autocast casts every weight at each "
                            "use")
            return
        reason = None
        if kind != "single":
            reason = "DDP wrapped the model before on_fit_start; its gradient buckets keep the float32 dtype"
        elif not kernels:
            reason = "torch path: only the optimizer kernel writes the 16-bit weights"
        elif not (len(swapped) == 1 and all_swapped):
            reason = "needs one swapped optimizer to hold the float32 masters"
        elif averaging:
            reason = (f"{type(averaging[0]).__name__} copies its average into the weights at train end, "
                      "which the float32 masters would overwrite")
        if reason is not None:
            self.report.add("casts", precision, SKIPPED, reason)
            return
        self._casts = CastState(pl_module, swapped[0], dtype)
        self.report.add("casts", precision, ON, f"{len(self._casts.cast)} params {str(dtype)[6:]} with "
                        "float32 masters; the step writes the 16-bit weights the forward reads (norms and "
                        "embeddings stay float32)")

    def _start_graphs(self, pl_module: Any, kind: str, device: torch.device) -> None:
        if not self.cuda_graphs:
            self.report.add("graphs", "cuda_graphs", OFF, "cuda_graphs=False: forward and backward launch "
                            "every kernel")
            return
        reason = graphs.why_no_graphs(kind, device)
        targets = graphs.graph_targets(pl_module) if reason is None else []
        if reason is None and not targets:
            reason = "no forward on the LightningModule and no child module with trainable params"
        if reason is not None:
            self.report.add("graphs", "cuda_graphs", SKIPPED, reason)
            return
        self._graphs = graphs.install(targets)
        names = ", ".join(name for name, _ in targets)
        self.report.add("graphs", names, ON, "forward + backward replayed from CUDA graphs per input shape "
                        "(first batch of a shape eager, second captured); loss, logging, hooks and "
                        "optimizer step eager")

    def _print(self, trainer: Any) -> None:
        if self.verbose and trainer.is_global_zero:
            print(self.report)

    # ---- every step ------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._ema_steps and trainer.global_step > self._last_step:
            self._ema.update()
            self._last_step = trainer.global_step
        if not self.log_grad_norm or self._norm_optimizer is None or not _log_step(trainer):
            return
        norm = self._norm_optimizer.grad_norm
        if norm is not None:
            pl_module.log("grad_norm", norm, on_step=True, on_epoch=False, logger=bool(trainer.loggers))

    # ---- evaluation on the EMA -------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._ema is not None:
            self._ema.swap_in(pl_module)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._ema is not None:
            self._ema.swap_out(pl_module)

    def on_test_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._ema is not None:
            self._ema.swap_in(pl_module)

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._ema is not None:
            self._ema.swap_out(pl_module)

    # ---- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # the live weights, also when a save happens while validation runs on the EMA
        weights = {} if self._ema is None else dict(self._ema.live_values())
        if self._casts is not None:
            weights.update(self._casts.float32_weights())
        plain_checkpoint(checkpoint, weights)

    def state_dict(self) -> dict[str, Any]:
        return {} if self._ema is None else {"ema": self._ema.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ema = state_dict.get("ema")
        if ema is None:
            return
        if self._ema is not None and self._applied:
            self._ema.load_state_dict(ema)
        else:  # the EMA is made at fit start, after Lightning restores callbacks
            self._ema_stash = ema


__all__ = ["FusedTraining"]
