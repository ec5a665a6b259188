"""Where the wall clock of an ultralytics ``train()`` goes: setup, the first step, training epochs,
validation, epoch ends and the final evaluation, from ultralytics' own callbacks.

:class:`Timeline` records the moments of one run (the GPU synchronized at each, so a part holds the
work it queued) and :meth:`Timeline.parts` splits the run's wall clock into parts that add up to it:

- ``setup``: from ``train()`` to ``on_train_start`` (model, datasets, loaders, optimizer, the
  changes a fused trainer makes, worker start);
- ``first_step``: from ``on_train_start`` to the end of the first iteration (the first batch's
  loading, compiling and capturing);
- ``train``: the rest of every epoch's iterations (batch loading included);
- ``validation``: ``on_val_start`` to ``on_val_end`` of each per-epoch validation;
- ``epoch_ends``: the rest of each epoch's end (EMA attributes, metrics, checkpoints, callbacks),
  up to the next epoch's first iteration;
- ``final``: after the last epoch's end until ``train()`` returns (ultralytics' final validation
  of best.pt, plots).

Under ultralytics' DDP (``device="0,1"``) the callbacks run in the ranks' processes, which
ultralytics starts with a pickled copy of the trainer's callbacks: with ``share=`` (a file path),
rank zero writes its moments there at ``on_train_end`` and :meth:`Timeline.stop` reads them in the
process that called ``train()``. The moments are ``time.perf_counter()``'s, the system-wide
monotonic clock on Linux, so both processes' moments lie on one time line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def _now(trainer=None) -> float:
    device = getattr(trainer, "device", None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Timeline:
    """The moments of one ``train()`` run. Call :meth:`start` right before ``model.train`` and
    :meth:`stop` right after it returns.

    Example:
        >>> timeline = Timeline().attach(model)              # doctest: +SKIP
        >>> timeline.start(); model.train(data=...); timeline.stop()   # doctest: +SKIP
        >>> timeline.parts()["validation"]                   # doctest: +SKIP
    """

    EVENTS = ("on_train_start", "on_train_epoch_start", "on_train_batch_end", "on_train_epoch_end",
              "on_val_start", "on_val_end", "on_fit_epoch_end", "on_model_save", "on_train_end")

    def __init__(self, share: str | Path | None = None) -> None:
        self.t0 = self.t1 = float("nan")
        self.marks: list[tuple[str, int, float]] = []  # (event, epoch, time)
        self.share = None if share is None else str(share)  # where DDP's rank zero leaves its moments
        self._batches = 0

    def attach(self, model) -> Timeline:
        for event in self.EVENTS:
            model.add_callback(event, self._recorder(event))
        return self

    def _recorder(self, event: str):
        def record(owner) -> None:
            if event == "on_train_batch_end":
                self._batches += 1
                if self._batches > 1:
                    return  # only the first iteration's end is a moment of its own
            # validator callbacks get the validator: its trainer is not reachable, its device is
            self.marks.append((event, getattr(owner, "epoch", -1), _now(owner)))
            if event == "on_train_end" and self.share and os.environ.get("RANK") == "0":
                Path(self.share).write_text(json.dumps(self.marks))  # a DDP rank: for the caller
        record.reads_checkpoint = False  # a fused trainer's save need not wait for its files for this
        return record

    def start(self) -> None:
        self.t0 = _now()

    def stop(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t1 = time.perf_counter()
        if not self.marks and self.share and Path(self.share).is_file():  # the run's ranks recorded them
            self.marks = [tuple(m) for m in json.loads(Path(self.share).read_text())]

    def _times(self, event: str) -> list[float]:
        return [t for e, _, t in self.marks if e == event]

    def parts(self) -> dict[str, float]:
        """The run's wall clock in seconds and its parts (module docstring), which add up to it,
        plus ``epochs`` (training time of each epoch, first iteration excluded from the first),
        ``epoch_total`` (each epoch start to the next, validation and end included), ``validations``
        (each validation, the final one last) and ``saves`` (each epoch's metrics CSV and checkpoint:
        from its validation's end to ``on_model_save``)."""
        start = self._times("on_train_start")[0]
        first = self._times("on_train_batch_end")[0]
        epoch_starts, epoch_ends = self._times("on_train_epoch_start"), self._times("on_train_epoch_end")
        val_starts, val_ends = self._times("on_val_start"), self._times("on_val_end")
        fit_ends = self._times("on_fit_epoch_end")
        epochs = [e - s for s, e in zip(epoch_starts, epoch_ends)]
        train = sum(epochs) - (first - epoch_starts[0])
        # the epochs' on_fit_epoch_end (final_eval fires one more after them): validation inside
        # the epochs' ends, the final evaluation after them has its own part
        last_end = fit_ends[len(epoch_ends) - 1] if len(fit_ends) >= len(epoch_ends) else epoch_ends[-1]
        validation = sum(e - s for s, e in zip(val_starts, val_ends) if e <= last_end)
        ends = sum(nxt - end for end, nxt in zip(epoch_ends, epoch_starts[1:] + [last_end])) - validation
        parts = {"wall": self.t1 - self.t0, "setup": start - self.t0, "first_step": first - epoch_starts[0],
                 "train": train, "validation": validation, "epoch_ends": ends, "final": self.t1 - last_end}
        # the gap from on_train_start to the first epoch's start belongs to setup
        parts["setup"] += epoch_starts[0] - start
        parts["epochs"] = epochs
        parts["epoch_total"] = [b - a for a, b in zip(epoch_starts, epoch_starts[1:] + [last_end])]
        parts["validations"] = [e - s for s, e in zip(val_starts, val_ends)]
        # inside the epoch ends: from each epoch's validation (or its training, without one) to its
        # on_model_save, ultralytics' metrics CSV and save_model
        saves = self._times("on_model_save")[:len(epoch_ends)]
        befores = [max([t for t in val_ends + epoch_ends if t <= save], default=save) for save in saves]
        parts["saves"] = [save - before for save, before in zip(saves, befores)]
        return parts


__all__ = ["Timeline"]
