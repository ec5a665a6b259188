"""The detection model's forward, loss and backward replayed from CUDA graphs inside ultralytics' loop.

Ultralytics' training loop calls ``loss, loss_items = model(batch)`` under autocast, then
``scaler.scale(loss.sum()).backward()``, and every ``accumulate`` iterations ``optimizer_step()``.
:class:`GraphedLoss` takes the place of the model's ``loss`` method for the training loop (an
attribute of the trainer's model instance, set by :class:`~trainfuse.ultralytics.FusedDetectionTrainer`
after its setup and removed when training ends; ultralytics' classes are not touched). Each call
runs, through :class:`~trainfuse.graphs.CapturedStep`:

    forward (autocast as the loop set it, weight cache off) -> FusedDetectionLoss
    -> scaler.scale(loss.sum()).backward(), accumulating into the params' grads

eagerly on an input shape's first sighting, captured on its second, replayed after that. The key
is the image batch's shape and the padded labels' capacity bucket, with the autocast state and
whether the call zeroes the grads first (below) as its bucket. What it returns to the loop is
the graph's loss as the output of an op whose backward does nothing, so the loop's own
``backward()`` (four small launches) finds the grads already there.

The optimizer phase (``scaler.step_and_update``: two launches that read lr, momentum, the scale
and the EMA weight from device memory) joins the graph of the iteration the loop steps after, once
it runs steadily (:meth:`GraphedLoss.fold_phase`): the loop steps when ``ni - last_opt_step >=
accumulate``, which this object follows by counting its calls since the last ``optimizer_step``
(reset where the loop resets its count, and never ahead of it: when unsure, the phase runs on its
own in ``optimizer_step``, as before). Such a call writes the phase's values first
(``prepare_step``), its graph ends with the phase and the grads zeroed (so a shape keeps two graphs:
the micro-batches' and the boundary's), and the trainer's ``optimizer_step`` then finds the step
done. A loop that does not step after such a call is warned about, and the phase runs on its own
from then on. Under DDP the phase stays outside (the all-reduce comes between the backward and the
phase).

The graphs accumulate into the grads they captured, so those are not freed after a step. Where the
phase ran on its own, the trainer sets :attr:`GraphedLoss.zero_first`, and the next call zeroes
them inside its graph (a graph of its own per shape) before the backward accumulates.

Beside the GPU JPEG decoding's thread the calls are paced (``paced=True``): each waits, before its
graphs, until the previous call's have run. Unpaced, the host runs ahead until a launch blocks in
the driver; there the decoding thread's own launches and copies waited with it (on the photo
benchmark: 3.7 ms of graph launch and 4.4 ms of that thread's launches and copies an iteration,
and 1,025 images/s against 1,136-1,162 paced).

Loss items come back without a host sync: each replay's items are copied to pinned memory
asynchronously, and the loop gets the newest ones the GPU has finished (a few iterations old while
the host runs ahead). The running means the progress bar shows lag the same way; at each epoch's
end :meth:`GraphedLoss.epoch_means` gives the exact means, summed on the GPU over every iteration.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from trainfuse.graphs import CapturedStep, GraphedOptimizerStep
from trainfuse.losses.detection.targets import PADDED_KEY

# loss-item copies in flight at once: the host runs at most this many iterations ahead of the GPU
RING = 4


class _Replayed(torch.autograd.Function):
    """The graph's loss, differentiable in form only: the replay already ran the backward, so the
    loop's ``backward()`` must reach no parameter (``anchor`` gives the result a grad_fn)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


def replayed_loss(loss: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``loss`` (already backpropagated) as a tensor whose ``backward()`` runs and changes nothing.

    Args:
        loss: the loss the captured step computed and backpropagated.
        anchor: a leaf with ``requires_grad=True`` (its ``.grad`` stays None).
    """
    return _Replayed.apply(loss, anchor)


class StepCadence:
    """Which iterations ultralytics' loop steps the optimizer after: those where ``ni - last_opt_step
    >= accumulate``, counted here as the iterations since the last ``optimizer_step``. A new cadence
    starts at 0 wherever the loop's own count restarts (training start, resume, NaN recovery: a new
    :class:`GraphedLoss`; an OOM retry: :meth:`restart`); the loop's count then starts at or above
    ours, so a step is never predicted where the loop would not take one.
    """

    def __init__(self) -> None:
        self.since = 0  # iterations since the loop's last optimizer_step, this one included
        self.ran = False  # the last iteration ran the step; the loop's optimizer_step comes next

    def next_iteration(self, accumulate: int) -> bool:
        """Count one iteration; True where the loop steps after it (at ``accumulate`` as it is now)."""
        self.since += 1
        return self.since >= accumulate

    def optimizer_stepped(self) -> bool:
        """The loop's ``optimizer_step``: True where the last iteration already ran the step."""
        ran, self.ran = self.ran, False
        self.since = 0
        return ran

    def missed(self) -> bool:
        """True (once) where the last iteration ran the step and the loop did not step after it."""
        missed, self.ran = self.ran, False
        return missed

    def restart(self) -> None:
        """The loop restarts its count (an OOM retry sets ``last_opt_step = -1``)."""
        self.since, self.ran = 0, False


class LossReadout:
    """Loss items read back without a host sync, and exact per-epoch means.

    Args:
        names: the loss items' names, in the order of the items vector.
        device: the CUDA device the items are computed on.
    """

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        self.names = tuple(names)
        self._slots = torch.zeros((RING, len(self.names)), dtype=torch.float32, pin_memory=True)
        self._events: list[torch.cuda.Event | None] = [None] * RING
        self._next = 0
        self._sum = torch.zeros(len(self.names), dtype=torch.float32, device=device)
        self._count = 0

    def start_epoch(self) -> None:
        """Restart the per-epoch sums (one fill on the GPU)."""
        self._sum.zero_()
        self._count = 0

    def push(self, items: torch.Tensor) -> dict[str, torch.Tensor]:
        """Add one iteration's ``items`` (a CUDA vector) to the epoch's sums and queue their copy.

        Returns:
            The newest items whose copy has finished, as 0-d CPU tensors by name: this call's
            when the GPU has caught up, else a few iterations older. It waits for the GPU only
            when no copy has finished yet, or ``RING`` copies are in flight.
        """
        self._sum += items
        self._count += 1
        k = self._next
        pending = self._events[k]
        if pending is not None:
            pending.synchronize()  # the ring is full: the oldest copy must land before its slot is reused
        self._slots[k].copy_(items, non_blocking=True)
        event = self._events[k] = torch.cuda.Event()
        event.record()
        self._next = (k + 1) % RING
        newest = None
        for back in range(RING):
            j = (k - back) % RING
            e = self._events[j]
            if e is not None and e.query():
                newest = j
                break
        if newest is None:  # nothing has landed yet (the first iterations): wait for the oldest
            newest = next(j for j in ((k + 1 + i) % RING for i in range(RING)) if self._events[j] is not None)
            self._events[newest].synchronize()
        return dict(zip(self.names, self._slots[newest].clone().unbind()))

    def epoch_means(self) -> dict[str, torch.Tensor] | None:
        """The exact mean of every item over this epoch's iterations (one host sync), or None
        before the epoch's first iteration."""
        if self._count == 0:
            return None
        return dict(zip(self.names, (self._sum / self._count).cpu().unbind()))


class GraphedLoss:
    """The model's training ``loss(batch)`` with forward, loss and backward run by a CapturedStep.

    Args:
        model: the trainer's DetectionModel, its criterion a FusedDetectionLoss.
        scaler: the trainer's GradScaler (its scale tensor is read by the graphs, updated in place).
        max_graphs: graphs kept at once (one per image shape, label capacity, and zeroing the
            grads first or not).
        grads: the grads to accumulate into, one per param that requires grad in
            ``model.parameters()`` order (views of a flat buffer, for one all-reduce under DDP);
            None: the first call's backward makes them.
        loss_factor: what the backward's loss is multiplied by: ultralytics multiplies it by the
            world size under DDP (for DDP's average), and GradScaler's overflows depend on it.
        paced: before each call's graphs, wait until the previous call's have run on the GPU, so
            the host is at most one iteration ahead. For a loop beside a thread that issues CUDA
            work of its own (the GPU JPEG decoding): a graph launched while its previous replay
            still runs holds the host inside the driver, and that thread's launches and copies
            wait there too (see the module).
    """

    def __init__(self, model: torch.nn.Module, scaler: torch.amp.GradScaler, *, max_graphs: int = 8,
                 grads: list[torch.Tensor] | None = None, loss_factor: int = 1, paced: bool = False) -> None:
        self.model = model
        self.paced = paced
        self._done: torch.cuda.Event | None = None  # the last call's end, when paced
        self.scaler = scaler
        self._max_graphs = max_graphs
        self.step = CapturedStep(self._forward_backward, max_graphs=max_graphs, name="yolo forward+backward")
        self.device = next(model.parameters()).device
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self.readout = LossReadout(model.criterion.loss_names, self.device)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._grads: list[torch.Tensor] | None = None
        self._loss_factor = loss_factor
        if grads is not None:
            params = self._params
            if len(grads) != len(params) or any(g.shape != p.shape for g, p in zip(grads, params)):
                raise ValueError(f"GraphedLoss: grads must hold one tensor per trainable param of the model, "
                                 f"in order ({len(self._params)}), got {len(grads)} of other shapes")
            self._grads = list(grads)
        # set by the trainer after an optimizer step: the next call zeroes the grads inside its
        # graph before the backward accumulates (zero_grad folded into the replay: no launch)
        self.zero_first = False
        self._items: torch.Tensor | None = None  # the last call's items, on the GPU
        # the optimizer phase inside the graphs (fold_phase)
        self._phase: GraphedOptimizerStep | None = None
        self._accumulate: Callable[[], int] | None = None
        self.cadence = StepCadence()
        self._folding = False  # the call being run ends with the phase

    # ---- what the loop calls -------------------------------------------------------------------
    def __call__(self, batch: dict, preds=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss * batch_size, loss items)`` as the model's ``loss`` returns them; the backward
        has already run (see the module docstring). Outside training (preds given, eval mode, grad
        off) it is the model's own ``loss``."""
        model = self.model
        if preds is not None or not model.training or not torch.is_grad_enabled() or PADDED_KEY not in batch:
            return type(model).loss(model, batch, preds)
        self.settle()
        self._restore_grads()
        img, padded = batch["img"], batch[PADDED_KEY]
        due = self.cadence.next_iteration(self._accumulate()) if self._phase is not None else False
        self._folding = fold = due and self._phase_due()
        bucket = (torch.is_autocast_enabled(self.device.type), torch.get_autocast_dtype(self.device.type),
                  self.zero_first and self._grads is not None, fold)
        if self._done is not None:
            self._done.synchronize()  # paced: the last call's graphs have run
        try:
            loss, items = self.step(img, padded, bucket=bucket)
        except BaseException:  # an OOM the loop retries restarts its step count (last_opt_step = -1)
            self.cadence.restart()
            raise
        if self.paced:
            self._done = self._done or torch.cuda.Event()
            self._done.record()
        self.cadence.ran = fold
        self.zero_first = False
        if self._grads is None:  # the first call made the grads: the graphs accumulate into these
            self._grads = [p.grad for p in self._params]
        self._items = items
        return replayed_loss(loss, self._anchor), self.readout.push(items)

    def _forward_backward(self, img: torch.Tensor, padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.zero_first and self._grads is not None:
            torch._foreach_zero_(self._grads)
        dtype = torch.get_autocast_dtype(self.device.type)
        enabled = torch.is_autocast_enabled(self.device.type)
        # the weight-cast cache off: a cast cached during a capture would live in the graphs' pool
        with torch.autocast(self.device.type, dtype=dtype, enabled=enabled, cache_enabled=False):
            preds = self.model(img)
            loss, items = self.model.criterion(preds, {"img": img, PADDED_KEY: padded})
        total = loss.sum() if self._loss_factor == 1 else loss.sum() * self._loss_factor
        self.scaler.scale(total).backward()
        if self._folding:  # the optimizer phase, then the grads zeroed for the next micro-batches
            self._phase.inside()
            torch._foreach_zero_(self._grads)  # (made by the first call: the phase has run since)
        return loss.detach(), torch.stack(tuple(items.values()))

    # ---- the optimizer phase inside the graphs -------------------------------------------------
    def fold_phase(self, phase: GraphedOptimizerStep, accumulate: Callable[[], int]) -> None:
        """Run ``phase`` inside the graph of each iteration the loop will step after, from when it
        is steady (see the module docstring).

        Args:
            phase: the trainer's optimizer phase over the grads these graphs accumulate into.
            accumulate: the loop's current ``accumulate`` (its warmup changes it).
        """
        self._phase, self._accumulate = phase, accumulate

    def optimizer_stepped(self) -> bool:
        """The loop's ``optimizer_step`` is running: True where the last call's graph already ran
        the phase (the caller then skips it)."""
        return self.cadence.optimizer_stepped()

    def settle(self) -> None:
        """Where the last call ran the phase and the loop did not step after it (a loop whose
        stepping rule this object does not follow), warn once and run the phase on its own from
        now on. Called before each call and at each epoch's end."""
        if not self.cadence.missed():
            return
        self._phase = None
        warnings.warn("GraphedLoss: the training loop did not step the optimizer after an iteration whose "
                      "graph ran the optimizer phase; the phase runs in optimizer_step from now on",
                      RuntimeWarning, stacklevel=3)

    def _phase_due(self) -> bool:
        """Whether this call, which the loop steps after, ends with the optimizer phase (after its
        ``prepare_step``): the phase is steady and still holds (else the graphs that ran it go)."""
        phase = self._phase
        if not phase.ready_to_fold():
            return False
        if not phase.fold_holds():
            self._renew_step()  # its graphs ran the phase over tensors that changed
            return False
        phase.prepare()
        return True

    def _renew_step(self) -> None:
        """A new CapturedStep: the graphs (and their memory pool) go; every key is new again."""
        self.step = CapturedStep(self._forward_backward, max_graphs=self._max_graphs, name=self.step.name)

    def _restore_grads(self) -> None:
        """Put the grads the graphs accumulate into back on the params, zeroed, after a
        ``zero_grad(set_to_none=True)`` (ultralytics calls one at the start of training and after
        NaN recovery)."""
        grads = self._grads
        if grads is None or all(p.grad is g for p, g in zip(self._params, grads)):
            return
        moved = [(p, g) for p, g in zip(self._params, grads) if p.grad is not g]
        if emptied := [g for p, g in moved if p.grad is None]:
            torch._foreach_zero_(emptied)
        for p, g in moved:
            if p.grad is not None:
                g.copy_(p.grad)
            p.grad = g

    # ---- installation --------------------------------------------------------------------------
    def attach(self) -> GraphedLoss:
        """Make the model's ``loss`` this object (an instance attribute; the class is untouched)."""
        self.model.loss = self
        return self

    def detach(self) -> None:
        """Give the model its own ``loss`` back; drop the graphs (their memory pool with them) and
        the grads they wrote (set to None, as a stock ``zero_grad`` leaves them)."""
        if self.model.__dict__.get("loss") is self:
            del self.model.loss
        self._renew_step()
        self._phase = None
        if self._grads is not None:
            for p, g in zip(self._params, self._grads):
                if p.grad is g:
                    p.grad = None
            self._grads = None

    def epoch_means(self) -> dict[str, torch.Tensor] | None:
        """The exact per-epoch means of the loss items (see :class:`LossReadout`)."""
        return self.readout.epoch_means()

    def last_items(self) -> dict[str, torch.Tensor] | None:
        """The last call's loss items as the model's ``loss`` returns them: 0-d tensors on the GPU
        (copies: the next replay overwrites the graph's), or None before the first call."""
        if self._items is None:
            return None
        return dict(zip(self.readout.names, self._items.clone().unbind()))


__all__ = ["RING", "GraphedLoss", "LossReadout", "StepCadence", "replayed_loss"]
