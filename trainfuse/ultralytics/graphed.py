"""A YOLO model's forward, loss and backward replayed from CUDA graphs inside ultralytics' loop.

Ultralytics' training loop calls ``loss, loss_items = model(batch)`` under autocast, then
``scaler.scale(loss.sum()).backward()``, and every ``accumulate`` iterations ``optimizer_step()``.
:class:`GraphedLoss` takes the place of the model's ``loss`` method for the training loop (an
attribute of the trainer's model instance, set by the trainer's graphs change and removed when
training ends; ultralytics' classes are not touched). Each call runs, through
:class:`~trainfuse.graphs.CapturedStep`:

    forward (autocast as the loop set it, weight cache off) -> the model's criterion
    -> scaler.scale(loss.sum()).backward(), accumulating into the params' grads

eagerly on an input shape's first sighting, captured on its second, replayed after that. The
graphs' inputs are the image batch and the labels the criterion reads (its ``keys``: the padded
boxes, with the keypoints or the masks' index maps of pose and segmentation models; the classes of
a classification model), each of a shape that repeats. The key is those inputs' shapes (the labels'
capacity bucket), with the autocast state,
whether the call zeroes the grads first and whether it ends with the optimizer phase as its
bucket. What it returns to the loop is the graph's loss as the output of an op whose backward
does nothing, so the loop's own ``backward()`` (four small launches) finds the grads already there.

Its collaborators each do one job: :class:`KeptGrads` (the grads the graphs accumulate into,
zeroed inside the next replay after an optimizer step), :class:`~trainfuse.ultralytics.phase_fold.
PhaseFold` (the optimizer phase inside the graph of the iterations the loop steps after),
:class:`Pacer` (each call waits for the last one's graphs beside the GPU JPEG decoding) and
:class:`~trainfuse.ultralytics.readout.LossReadout` (the items read back without a host sync;
the progress bar's running means lag a few iterations, the epoch's means are exact).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainfuse.graphs import CapturedStep, GraphedOptimizerStep
from trainfuse.losses.detection import PADDED_KEY
from trainfuse.ultralytics.phase_fold import PhaseFold
from trainfuse.ultralytics.readout import LossReadout


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


class KeptGrads:
    """The grads the graphs accumulate into: made by the first call's backward (or given, as views
    of a flat buffer for one all-reduce), kept on the params from then on.

    Where the first backward made them, later backwards write fresh grads and :meth:`fold_in`
    adds them to the kept ones in a few multi-tensor launches (one per dtype and chunk of tensors)
    instead of autograd's one add per param (yolo11m: about 110 float16 weight grads, each its own
    small kernel in every replay); the first backward after an optimizer step copies them instead
    of zeroing and adding. The same sums in the same float32 arithmetic (a signed zero aside).
    Given grads (DDP's bucket views) are accumulated into by autograd as before.

    Args:
        params: the trainable params, in ``model.parameters()`` order.
        grads: their grads to keep, or None: the first backward makes them (:meth:`captured`).
    """

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor] | None = None) -> None:
        self.params = params
        if grads is not None and (len(grads) != len(params)
                                  or any(g.shape != p.shape for g, p in zip(grads, params))):
            raise ValueError(f"GraphedLoss: grads must hold one tensor per trainable param of the model, "
                             f"in order ({len(params)}), got {len(grads)} of other shapes")
        self.grads = None if grads is None else list(grads)
        self.folds = grads is None  # later backwards write fresh grads, folded in (fold_in)
        self.zero_first = False  # the next call zeroes them inside its graph before the backward

    def begin_backward(self) -> bool:
        """Before a call's backward: where the grads are folded in, take them off the params (the
        backward then writes fresh ones) and return True."""
        if not self.folds or self.grads is None:
            return False
        for p in self.params:
            p.grad = None
        return True

    def fold_in(self, zero_first: bool) -> None:
        """After a backward that :meth:`begin_backward` prepared: the kept grads plus the fresh
        ones (``zero_first``: the fresh ones; a param the backward did not reach: 0), put back on
        the params. One ``_foreach`` launch per dtype (torch's fast path wants one dtype a list)."""
        pairs: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        missed = []
        for p, kept in zip(self.params, self.grads):
            fresh = p.grad
            if fresh is None:
                missed.append(kept)
            elif fresh.stride() != kept.stride():  # as autograd's add would (rare: a new layout)
                kept.copy_(fresh) if zero_first else kept.add_(fresh)
            else:
                into, src = pairs.setdefault((kept.dtype, kept.device), ([], []))
                into.append(kept)
                src.append(fresh)
            p.grad = kept
        for into, src in pairs.values():
            if zero_first:
                torch._foreach_copy_(into, src)
            else:
                torch._foreach_add_(into, src)
        if zero_first and missed:
            torch._foreach_zero_(missed)

    def zero_grad(self) -> None:
        """After an optimizer step: the next call zeroes the grads inside its graph (no launch)."""
        self.zero_first = self.grads is not None

    def restore(self) -> None:
        """Put the kept grads back on the params after a ``zero_grad(set_to_none=True)`` (ultralytics'
        own optimizer phase, the start of training, a NaN recovery): all of them dropped, they are
        zeroed inside the next call's graph; some, those are zeroed now."""
        grads = self.grads
        if grads is None or all(p.grad is g for p, g in zip(self.params, grads)):
            return
        moved = [(p, g) for p, g in zip(self.params, grads) if p.grad is not g]
        if len(moved) == len(grads) and all(p.grad is None for p, _ in moved):
            self.zero_first = True
        elif emptied := [g for p, g in moved if p.grad is None]:
            torch._foreach_zero_(emptied)
        for p, g in moved:
            if p.grad is not None:
                g.copy_(p.grad)
            p.grad = g

    def captured(self) -> None:
        """A call ran: the grads its backward made are the ones kept from now on."""
        self.zero_first = False
        if self.grads is None:
            self.grads = [p.grad for p in self.params]

    def zero_inside(self) -> None:
        """Inside a call's graph: zero the kept grads (before the backward, or after the phase)."""
        torch._foreach_zero_(self.grads)

    def release(self) -> None:
        """Set the params' kept grads to None, as a stock ``zero_grad`` leaves them."""
        if self.grads is not None:
            for p, g in zip(self.params, self.grads):
                if p.grad is g:
                    p.grad = None
            self.grads = None


class Pacer:
    """Beside a thread that issues CUDA work of its own (the GPU JPEG decoding), each call waits,
    before its graphs, until the previous call's have run: a graph launched while its previous
    replay still runs holds the host inside the driver, and that thread's launches and copies wait
    there too (on the photo benchmark: 3.7 ms of graph launch and 4.4 ms of that thread's launches
    and copies an iteration, and 1,025 images/s against 1,136-1,162 paced).

    Args:
        on: pace (else :meth:`wait` and :meth:`record` do nothing).
    """

    def __init__(self, on: bool) -> None:
        self.on = on
        self._done: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def record(self) -> None:
        if self.on:
            self._done = self._done or torch.cuda.Event()
            self._done.record()


class GraphedLoss:
    """The model's training ``loss(batch)`` with forward, loss and backward run by a CapturedStep.

    Args:
        model: the trainer's model, its criterion a loss without host syncs (a fused loss, or
            ultralytics' classification loss).
        scaler: the trainer's GradScaler (its scale tensor is read by the graphs, updated in place).
        max_graphs: graphs kept at once (one per image shape, label capacity, zeroing the grads
            first or not, and ending with the optimizer phase or not).
        grads: the grads to accumulate into, one per param that requires grad in
            ``model.parameters()`` order (views of a flat buffer, for one all-reduce under DDP);
            None: the first call's backward makes them.
        loss_factor: what the backward's loss is multiplied by: ultralytics multiplies it by the
            world size under DDP (for DDP's average), and GradScaler's overflows depend on it.
        paced: each call waits until the previous call's graphs have run (:class:`Pacer`).
        keys: the batch keys besides ``"img"`` the criterion reads in a training step, each a CUDA
            tensor of a shape that repeats (the graphs' inputs); a batch without one of them runs
            the model's own ``loss``.
        names: the loss items' names, in the order of the criterion's items dict (None: its
            ``loss_names``).
    """

    def __init__(self, model: torch.nn.Module, scaler: torch.amp.GradScaler, *, max_graphs: int = 8,
                 grads: list[torch.Tensor] | None = None, loss_factor: int = 1, paced: bool = False,
                 keys: tuple[str, ...] = (PADDED_KEY,), names: tuple[str, ...] | None = None) -> None:
        if not keys or "img" in keys:
            raise ValueError(f"GraphedLoss: keys must name the labels the criterion reads besides 'img', got "
                             f"{keys!r}")
        self.model = model
        self.keys = tuple(keys)
        self.scaler = scaler
        self._max_graphs = max_graphs
        self.step = CapturedStep(self._forward_backward, max_graphs=max_graphs, name="yolo forward+backward")
        self.device = next(model.parameters()).device
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self.readout = LossReadout(model.criterion.loss_names if names is None else names, self.device)
        self.kept = KeptGrads([p for p in model.parameters() if p.requires_grad], grads)
        self.pacer = Pacer(paced)
        self.fold: PhaseFold | None = None  # the optimizer phase inside the graphs (fold_phase)
        self._loss_factor = loss_factor
        self._folding = False  # the call being run ends with the phase
        self._items: torch.Tensor | None = None  # the last call's items, on the GPU

    # ---- what the loop calls -------------------------------------------------------------------
    def __call__(self, batch: dict, preds=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss * batch_size, loss items)`` as the model's ``loss`` returns them; the backward
        has already run (see the module docstring). Outside training (preds given, eval mode, grad
        off, a label key missing: not padded) it is the model's own ``loss``."""
        model = self.model
        if (preds is not None or not model.training or not torch.is_grad_enabled()
                or any(k not in batch for k in self.keys)):
            return type(model).loss(model, batch, preds)
        self.kept.restore()
        fold = self._folding = self.fold is not None and self.fold.begin(self._renew_step)
        bucket = (torch.is_autocast_enabled(self.device.type), torch.get_autocast_dtype(self.device.type),
                  self.kept.zero_first, fold)
        self.pacer.wait()
        try:
            loss, items = self.step(batch["img"], *(batch[k] for k in self.keys), bucket=bucket)
        except BaseException:
            if self.fold is not None:
                self.fold.failed()
            raise
        self.pacer.record()
        if self.fold is not None:
            self.fold.ran(fold)
        self.kept.captured()
        self._items = items
        return replayed_loss(loss, self._anchor), self.readout.push(items)

    def _forward_backward(self, img: torch.Tensor, *labels: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.kept
        folds = kept.begin_backward()  # fresh grads, added to the kept ones after the backward
        if kept.zero_first and not folds:
            kept.zero_inside()
        dtype = torch.get_autocast_dtype(self.device.type)
        enabled = torch.is_autocast_enabled(self.device.type)
        # the weight-cast cache off: a cast cached during a capture would live in the graphs' pool
        with torch.autocast(self.device.type, dtype=dtype, enabled=enabled, cache_enabled=False):
            preds = self.model(img)
            loss, items = self.model.criterion(preds, {"img": img, **dict(zip(self.keys, labels))})
        total = loss.sum() if self._loss_factor == 1 else loss.sum() * self._loss_factor
        self.scaler.scale(total).backward()
        if folds:
            kept.fold_in(kept.zero_first)
        if self._folding:  # the optimizer phase, then the grads zeroed for the next micro-batches
            self.fold.inside()
            self.kept.zero_inside()  # (made by the first call: the phase has run since)
        return loss.detach(), torch.stack(tuple(items.values()))

    # ---- the optimizer step ----------------------------------------------------------------------
    def fold_phase(self, phase: GraphedOptimizerStep, accumulate: Callable[[], int]) -> None:
        """Run ``phase`` inside the graph of each iteration the loop will step after, from when it
        is steady (:class:`~trainfuse.ultralytics.phase_fold.PhaseFold`).

        Args:
            phase: the trainer's optimizer phase over the grads these graphs accumulate into.
            accumulate: the loop's current ``accumulate`` (its warmup changes it).
        """
        self.fold = PhaseFold(phase, accumulate)

    def optimizer_stepped(self) -> bool:
        """The loop's ``optimizer_step`` is running: True where the last call's graph already ran
        the phase (the caller then skips it)."""
        return self.fold is not None and self.fold.optimizer_stepped()

    def zero_grad(self) -> None:
        """The optimizer stepped outside the graphs: the next call zeroes the grads inside its
        graph before the backward accumulates (zero_grad folded into the replay: no launch)."""
        self.kept.zero_grad()

    def _renew_step(self) -> None:
        """A new CapturedStep: the graphs (and their memory pool) go; every key is new again."""
        self.step = CapturedStep(self._forward_backward, max_graphs=self._max_graphs, name=self.step.name)

    # ---- installation ----------------------------------------------------------------------------
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
        self.fold = None
        self.kept.release()

    # ---- what the epoch logs ---------------------------------------------------------------------
    def epoch_means(self) -> dict[str, torch.Tensor] | None:
        """The exact per-epoch means of the loss items (see :class:`LossReadout`)."""
        return self.readout.epoch_means()

    def last_items(self) -> dict[str, torch.Tensor] | None:
        """The last call's loss items as the model's ``loss`` returns them: 0-d tensors on the GPU
        (copies: the next replay overwrites the graph's), or None before the first call."""
        if self._items is None:
            return None
        return dict(zip(self.readout.names, self._items.clone().unbind()))


__all__ = ["GraphedLoss", "KeptGrads", "Pacer", "replayed_loss"]
