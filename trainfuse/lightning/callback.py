"""FusedTraining: trainfuse's kernels in a Lightning run, switched on by one callback."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from trainfuse._runtime.backend import use_triton
from trainfuse.clients import AppliedChanges, Report
from trainfuse.graphs import GraphedModule, StepStats
from trainfuse.lightning import _compat
from trainfuse.lightning.changes import (
    EMA,
    Backend,
    BatchNormSiLUFusion,
    Casts,
    Change,
    Clipping,
    EvaluateOnEMA,
    FlatAllReduce,
    Graphs,
    LossFusion,
    MLPFusion,
    OptimizerPhase,
    OptimizerSwap,
    Precision,
    Run,
    Scaler,
    Strategy,
)
from trainfuse.lightning.checkpoint import plain_checkpoint, saved_average

if TYPE_CHECKING:
    import lightning.pytorch as pl


class FusedTraining(*_compat.callback_bases()):
    """Runs a Lightning fit on trainfuse's fused kernels.

    At fit start (after Lightning restored a checkpoint's optimizer when ``ckpt_path=`` is given)
    it makes its changes in this order, each a :class:`~trainfuse.lightning.changes.Change` with
    a row in :attr:`report` (what runs now, or why it was left alone):

    1. ``backend``: which code runs, the Triton kernels or torch's path (nothing changes);
    2. ``precision``: any precision but 32-true/16-mixed/bf16-mixed leaves the run stock;
    3. ``strategy``: single-device, DDP, FSDP (``FSDPStrategy(use_orig_params=True)``, Lightning's
       default) and FSDP2 (``ModelParallelStrategy`` with ``fully_shard``) are taken; any other
       strategy (DeepSpeed, XLA...) and the layouts the fused step cannot clip
       (``use_orig_params=False``, hybrid sharding, tensor parallelism) leave the run stock. Under
       FSDP and FSDP2 each rank's fused step takes its own shards, and ``mlp``, ``ema``, ``casts``
       and ``graphs`` are skipped, with the reason;
    4. ``mlp``: Linear/activation ``nn.Sequential`` chains -> ``trainfuse.nn.FusedMLP``;
    5. ``loss``: ``nn.BCEWithLogitsLoss`` -> ``trainfuse.losses.BCEWithLogitsLoss``; with
       ``bn_silu=True``, ``bn_silu``: a BatchNorm2d followed by a SiLU in an ``nn.Sequential`` ->
       one op (:mod:`trainfuse.nn.conv_block`; the Sequential's own modules back at the end);
    6. ``optimizer``: ``torch.optim.AdamW``/``Adam``/``SGD`` -> FusedAdamW/FusedAdam/FusedSGD
       (same param groups, state and schedulers), unless the step cannot take them (sparse
       gradients, step hooks, manual optimization under 16-mixed's GradScaler...); a
       ``torch.optim.Muon`` -> FusedMuon, also under manual optimization beside an AdamW;
    7. ``clipping``: ``Trainer(gradient_clip_val=...)`` inside the fused step (by norm:
       ``max_grad_norm``; by value: ``max_grad_value``), the Trainer's own clipping off meanwhile;
    8. ``ema``: an EMA inside the optimizer step, with EMAWeightAveraging's semantics;
    9. ``casts``: under 16-mixed/bf16-mixed, 16-bit weights with float32 masters in the
       optimizer (:func:`trainfuse.amp.fuse_casts`);
    10. ``scaler``: under 16-mixed, trainfuse's GradScaler for Lightning's;
    11. ``ddp``: under DDP, the grads averaged by one all-reduce of a flat buffer per optimizer
        step, DDP's reducer off (:class:`~trainfuse.lightning.changes.FlatAllReduce`), unless
        the run keeps DDP's reducer (the row says why);
    12. ``graphs``: forward and backward replayed from CUDA graphs;
    13. ``optimizer_graph``: with graphs, the fused step (clip, update, EMA) replayed from a CUDA
        graph of its own under 32-true, bf16-mixed and 16-mixed (the GradScaler's step and
        update inside), one for each optimizer of a run with several or under manual
        optimization (:mod:`trainfuse.lightning.changes.phase`;
        ``TRAINFUSE_GRAPH_LIGHTNING_PHASE=0`` keeps it eager);
    14. ``ema`` again, with ``ema_decay``: validation inside the fit runs on the EMA (no row of
        its own: the first ``ema`` row says so).

    Modules that torch.compile compiled keep their own forward (``mlp`` and ``loss`` rows
    ``skipped``, with the reason): those inside a ``torch.compile``'d child module, and all of them
    when ``trainer.fit`` is given ``torch.compile(model)``; then ``graphs`` is skipped too, and the
    optimizer swap, clipping, EMA and casts, which act outside the compiled code, are made as usual.

    When training ends, and on an exception (Lightning then calls ``on_exception``, not
    ``teardown``), the changes are undone in reverse order: the weights are float32 again, the
    Trainer has its clipping and its scaler back, the modules their own forward; after a fit that
    ended the module holds the EMA, as under EMAWeightAveraging. Checkpoints stay plain (float32
    weights, torch.optim state layout; with an EMA, WeightAveraging's layout). The report is
    logged on rank zero (Lightning's ``rank_zero_info``).

    Args:
        fuse_casts: under 16-mixed/bf16-mixed, 16-bit weights with float32 masters (the optimizer
            writes the weights the forward reads; autocast no longer re-casts them at each use).
        ema_decay: keep an EMA of the weights and buffers with this decay (Lightning's
            EMAWeightAveraging schedule: the first update copies); validation inside the fit runs
            on it, the module holds it after the fit, and checkpoints save it as their
            ``state_dict`` (the live weights as ``current_model_state``). None: no EMA.
        mlp: swap Linear/activation ``nn.Sequential`` chains for ``trainfuse.nn.FusedMLP``.
        losses: swap ``nn.BCEWithLogitsLoss`` modules for ``trainfuse.losses.BCEWithLogitsLoss``.
        strict: raise :class:`trainfuse.lightning.SkipError` instead of skipping anything.
        log_grad_norm: log the pre-clip gradient norm as ``grad_norm`` (a device tensor, no sync) on
            the steps where the Trainer writes its logs (every ``log_every_n_steps``): a
            ``self.log`` call costs more host time than the whole fused step
            when clipping by norm runs in the step.
        verbose: log the report table on rank zero at fit start.
        cuda_graphs: replay the model's forward and backward from CUDA graphs, one pair per input
            shape (the first batch of a shape runs eagerly, the second is captured): the
            LightningModule's ``forward`` when it defines one, and each direct child module with
            trainable params that ``training_step`` calls. The loss, ``self.log``, hooks and the
            optimizer step run eagerly as before. For static shapes and forwards whose Python
            does the same every step (a replay repeats what the forward decided at capture); a
            forward that syncs with the host runs eagerly, with the reason in
            :attr:`graph_reasons`. Off on CPU. Under DDP the grads are averaged by one
            all-reduce of a flat buffer per optimizer step (DDP's reducer off).
        bn_silu: a BatchNorm2d followed by a SiLU in an ``nn.Sequential`` as one op (training
            statistics, normalize and SiLU in two launches forward, two backward; off by
            default).

    Example::

        trainer = Trainer(precision="bf16-mixed", gradient_clip_val=1.0,
                          callbacks=[FusedTraining(ema_decay=0.999)])
        trainer.fit(model)
    """

    def __init__(self, *, fuse_casts: bool = True, ema_decay: float | None = None, mlp: bool = True,
                 losses: bool = True, strict: bool = False, log_grad_norm: bool = True,
                 verbose: bool = True, cuda_graphs: bool = False, bn_silu: bool = False) -> None:
        for name, value in (("fuse_casts", fuse_casts), ("mlp", mlp), ("losses", losses), ("strict", strict),
                            ("log_grad_norm", log_grad_norm), ("verbose", verbose),
                            ("cuda_graphs", cuda_graphs), ("bn_silu", bn_silu)):
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
        self.bn_silu = bn_silu
        self.report = Report("FusedTraining", strict)
        self._graphs: dict[str, GraphedModule] = {}
        self._all_reduce: FlatAllReduce | None = None
        self._phase: OptimizerPhase | None = None
        self._reset()

    def _reset(self) -> None:
        self._run: Run | None = None  # set when the changes are made, for the fit's duration
        self._applied: AppliedChanges[Run] = AppliedChanges(self.report)
        self._deferred = False
        self._resumed: tuple[dict, int] | None = None  # the average of the checkpoint resumed from
        self._ema: EMA | None = None  # the fit's EMA, once made (kept after the fit for checkpoints)

    @property
    def graph_stats(self) -> dict[str, StepStats]:
        """Per graphed module (``"forward"``: the LightningModule's own): its eager calls, replays,
        captures, failed captures and evictions, from the last fit (kept after it ends)."""
        return {name: g.stats for name, g in self._graphs.items()}

    @property
    def optimizer_phase_stats(self) -> dict[str, int] | None:
        """Where the optimizer steps replayed from CUDA graphs of their own in the last fit (the
        ``optimizer_graph`` rows on): their eager steps, captures and replays, summed over the
        optimizers; else None."""
        return None if self._phase is None else self._phase.stats

    @property
    def overlapped_steps(self) -> int:
        """Under DDP with graphs, the optimizer steps of the last fit whose gradient all-reduce ran
        inside the replayed backward, overlapping it (the others all-reduced after the backward)."""
        return 0 if self._all_reduce is None else self._all_reduce.overlapped

    @property
    def graph_reasons(self) -> dict[str, dict]:
        """Per graphed module, the input keys that ran eagerly because of a host sync or a failed
        capture, with why."""
        return {name: g.reasons for name, g in self._graphs.items() if g.reasons}

    # ---- the changes -----------------------------------------------------------------------------
    def _changes(self, run: Run) -> list[Change]:
        """This run's changes, in the order they are made."""
        changes: list[Change] = [Backend(), Precision(), Strategy()]
        if self.mlp:
            changes.append(MLPFusion())
        if self.losses:
            changes.append(LossFusion())
        if self.bn_silu:
            changes.append(BatchNormSiLUFusion())
        ema = EMA(self.ema_decay, self._resumed)
        changes += [OptimizerSwap(), Clipping(self.log_grad_norm), ema, Casts(self.fuse_casts)]
        if run.precision == "16-mixed":
            changes.append(Scaler())
        ddp = self._all_reduce = FlatAllReduce() if run.strategy == "ddp" else None
        if ddp is not None:
            changes.append(ddp)
        graphs = Graphs(self.cuda_graphs, self._graphs, ddp)
        self._phase = OptimizerPhase(graphs)
        changes += [graphs, self._phase]
        if self.ema_decay is not None:
            changes.append(EvaluateOnEMA(ema))
        return changes

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Make every change that applies, with its rows; log the report on rank zero."""
        device = trainer.strategy.root_device
        run = Run(trainer, pl_module, device, use_triton(device), str(trainer.precision),
                  _compat.strategy_kind(trainer.strategy))
        self._run = run
        self._applied.apply(self._changes(run), run)
        self._ema = self._applied.find(EMA)
        if self.verbose:
            _compat.rank_zero_info(trainer, str(self.report))

    def _end(self, *, failed: bool) -> None:
        """Undo the applied changes in reverse order (each one, even when another raises)."""
        self._applied.restore(self._run, failed=failed)

    # ---- when it acts ----------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Fit begins: refuse a second average of the weights, and forget the last fit's state."""
        if stage != "fit":
            return
        averaging = _compat.weight_averaging_callbacks(trainer.callbacks)
        if averaging and self.ema_decay is not None:
            raise ValueError(
                f"FusedTraining(ema_decay={self.ema_decay}) and {type(averaging[0]).__name__} both keep an "
                f"average of the weights: remove {type(averaging[0]).__name__} (FusedTraining's EMA follows "
                "its schedule inside the optimizer step) or drop ema_decay")
        self._reset()
        self._graphs.clear()
        self.report.clear()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Make the changes, unless the fit resumes from a checkpoint: Lightning loads its optimizer
        state after this hook, so the swap waits for ``on_train_start`` and carries it over."""
        if trainer.ckpt_path is not None:
            self._deferred = True
            return
        self._start(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Make the changes of a resumed fit (its checkpoint is fully loaded now)."""
        if self._deferred and self._run is None:
            self._start(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """A training batch begins: graphed DDP learns whether it ends the accumulation."""
        for change in self._applied:
            change.before_batch(self._run, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        """Before each training backward: eager DDP's grads go back into the flat buffer."""
        for change in self._applied:
            change.before_backward(self._run)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """After each batch: the EMA update when no optimizer step does it, ``grad_norm``'s log."""
        for change in self._applied:
            change.after_batch(self._run)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """The step's grads are complete (accumulation done): the all-reduce of graphed DDP."""
        for change in self._applied:
            change.before_optimizer_step(self._run, optimizer)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation inside the fit begins: the EMA goes into the module."""
        for change in self._applied:
            change.validation_starts(self._run)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation inside the fit ended: the live weights come back."""
        for change in self._applied:
            change.validation_ends(self._run)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training ended: undo the changes (the module holds the EMA from now on, as under
        EMAWeightAveraging, whose ``on_train_end`` copies it in)."""
        self._end(failed=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Fit ends: undo what a fit without a training loop (nothing left to train) still holds."""
        if stage == "fit":
            self._end(failed=False)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """The fit raised (Lightning calls no ``teardown`` then): undo every change, the module
        keeps its live weights."""
        self._end(failed=True)

    # ---- checkpoints -----------------------------------------------------------------------------
    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """A checkpoint: float32 weights, torch.optim's layout, and with the fit's EMA,
        EMAWeightAveraging's layout (see :mod:`trainfuse.lightning.checkpoint`), also for a save
        after the fit (ModelCheckpoint's at train end or on an exception)."""
        live: dict = {}
        ema, casts = self._ema, next((c for c in self._applied if isinstance(c, Casts)), None)
        if ema is not None:  # the live weights where the module holds the average
            live.update(ema.live_values())
        if casts is not None:
            live.update(casts.float32_weights())
        if ema is None:
            plain_checkpoint(checkpoint, live)
        else:
            plain_checkpoint(checkpoint, live, ema.ema.values(), ema.ema.updates)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """A fit resumes: with the EMA on and a checkpoint in WeightAveraging's layout, the
        average continues from its ``state_dict`` and the module takes the live weights (Lightning
        has just loaded the average into it). Outside a fit the module keeps the average."""
        if self.ema_decay is None or trainer.state.fn != "fit":
            return
        found = saved_average(checkpoint)
        if found is not None:
            self._resumed = found
            pl_module.load_state_dict(checkpoint["current_model_state"], strict=pl_module.strict_loading)


__all__ = ["FusedTraining"]
