"""Checkpoints off the training loop's critical path, and never torn.

ultralytics' ``BaseTrainer.save_model`` checks the EMA for NaN/Inf (one host sync per tensor),
deep-copies the EMA and the optimizer state (a Python ``__deepcopy__`` per tensor), casts the EMA
to half, ``torch.save``s them (device-to-host copies) and writes the bytes over last.pt, all on the
training thread. :meth:`CheckpointWriter.save` keeps on that thread only what must see the live
state: the NaN/Inf check and re-sync (one host sync), copies of the EMA's params and buffers and of
the optimizer state (a few multi-tensor launches, queued on the device), and the checkpoint's other
entries. One background thread then deep-copies the EMA module's Python structure around those
copies (the live module's tensors are never read: each maps to its copy), waits for the copies (an
event; its own work on a side stream), makes the EMA half, contiguous and clamped as stock does,
``torch.save``s the checkpoint once and writes last.pt (best.pt and epochN.pt where stock writes
them) from those bytes, each through :func:`write_atomically`: a process killed at any moment
leaves the previous file or the new one.

At most one checkpoint is in flight: a new save waits for the previous one, and so does every read
of a checkpoint later in the run (:meth:`CheckpointWriter.flush`, which raises a failed write's
error on the calling thread). The EMA module's structure must not change until the thread has
copied it: :meth:`CheckpointWriter.wait_copied` waits for that (the trainer calls it at each
epoch's end, before ultralytics updates the EMA's attributes and validates it).
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from copy import deepcopy
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn
from ultralytics import __version__
from ultralytics.utils import GIT, LOGGER, colorstr
from ultralytics.utils.torch_utils import convert_optimizer_state_dict_to_fp16, qat_state, unwrap_model

from trainfuse.graphs.sync import background_syncs
from trainfuse.optim import torch_state_dict

_PREFIX = colorstr("trainfuse:")
PARTIAL_SUFFIX = ".partial"  # a temporary file's name ends so: no "*.pt" glob picks up a partial file


class CheckpointWriteError(RuntimeError):
    """A checkpoint written in the background failed; raised on the training thread."""


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that neither a reader nor a process killed meanwhile sees a
    partial file: a temporary file in the same folder, flushed and fsynced, renamed over ``path``
    (``os.replace``, atomic within a file system), then the folder fsynced so the rename is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if os.name == "posix":  # Windows opens no folder for an fsync
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _serialize_and_write(serialize: Callable[[], bytes], paths: tuple[Path, ...]) -> None:
    data = serialize()
    for path in paths:
        write_atomically(path, data)


class CheckpointWriter:
    """Writes checkpoints in one background thread, one at a time (see the module docstring).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp())
        >>> writer = CheckpointWriter()
        >>> writer.write(lambda: b"weights", [folder / "last.pt", folder / "best.pt"])
        >>> writer.flush()  # waits; a failed write raises CheckpointWriteError here
        >>> (folder / "best.pt").read_bytes()
        b'weights'
        >>> writer.close()
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[Future, tuple[Path, ...]] | None = None
        self._copied: threading.Event | None = None  # set once the write in flight copied the EMA's structure
        self._told: set[str] = set()

    def write(self, serialize: Callable[[], bytes], paths: Sequence[Path]) -> None:
        """Wait for the checkpoint in flight, then in the background call ``serialize`` and write
        its bytes to each of ``paths`` in turn (:func:`write_atomically`)."""
        self.flush()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainfuse-checkpoint")
        paths = tuple(Path(p) for p in paths)
        self._pending = (self._executor.submit(_serialize_and_write, serialize, paths), paths)

    def wait_copied(self) -> None:
        """Wait until the checkpoint in flight no longer reads the live EMA module's structure (its
        copy is made; a failed one raises at :meth:`flush`)."""
        if self._copied is not None:
            self._copied.wait()

    def flush(self) -> None:
        """Wait for the checkpoint in flight; raise :class:`CheckpointWriteError` if it failed."""
        if self._pending is None:
            return
        (future, paths), self._pending = self._pending, None
        try:
            future.result()
        except Exception as e:
            names = ", ".join(str(p) for p in paths)
            raise CheckpointWriteError(f"CheckpointWriter: writing {names} in the background failed with "
                                       f"{type(e).__name__}: {e}") from e

    def close(self, *, raise_error: bool = True) -> None:
        """Flush and end the thread (a later write starts another). ``raise_error=False`` logs a
        failed write instead of raising it (a run that raised already has its own error to raise)."""
        try:
            self.flush()
        except CheckpointWriteError as e:
            if raise_error:
                raise
            LOGGER.error(f"{_PREFIX} {e}")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def save(self, trainer: Any, *, torch_layout: bool = False) -> bool:
        """``BaseTrainer.save_model`` for ``trainer`` (ultralytics' trainer, rank 0) through this
        writer: True once the checkpoint is snapshotted and handed to the thread; False, after
        waiting for the checkpoint in flight and logging why, where no snapshot can be taken (the
        caller then saves as stock does). ``torch_layout``: the optimizer is a fused one, whose
        state is written in torch.optim's layout (:func:`trainfuse.optim.torch_state_dict`)."""
        self.flush()
        why = why_no_snapshot(trainer)
        if why is None:
            try:
                taken = snapshot(trainer)
            except Exception as e:  # an out-of-memory copy, a module deepcopy refuses
                why = f"its snapshot failed ({type(e).__name__}: {e})"
        if why is not None:
            if why not in self._told:
                self._told.add(why)
                LOGGER.info(f"{_PREFIX} checkpoints written by ultralytics on the training thread: {why}")
            return False
        self.write(lambda: serialize(taken, torch_layout=torch_layout), targets(trainer))
        self._copied = taken.copied
        # ultralytics runs on_model_save once the files are written: a callback of the user's may read them
        if any(reads_checkpoint(c) for c in trainer.callbacks.get("on_model_save", ())):
            self.flush()
        return True


def reads_checkpoint(callback: Callable) -> bool:
    """Whether an ``on_model_save`` callback may read the files just saved, so that the save waits
    for them: any but ultralytics' own, and but one that says it does not (an attribute
    ``reads_checkpoint = False`` on the callable, as a timer's)."""
    if getattr(callback, "__module__", "").startswith("ultralytics."):
        return False
    return bool(getattr(callback, "reads_checkpoint", True))


def why_no_snapshot(trainer: Any) -> str | None:
    """Why :meth:`CheckpointWriter.save` leaves ``trainer``'s checkpoint to ultralytics, or None."""
    if trainer.device.type not in ("cpu", "cuda"):
        return f"the background writer copies from CPU and CUDA tensors, the run is on {trainer.device.type}"
    if qat_state(trainer.ema.ema) is not None:
        return "the EMA is quantization-aware (ModelOpt), which stock's save strips from its copy"
    return None


def resync_non_finite(ema: nn.Module, model: nn.Module) -> None:
    """Stock's NaN/Inf re-sync of the live EMA (``BaseTrainer.save_model``): each EMA tensor that
    holds a non-finite value is copied from ``model``'s where that one is all finite. One host sync
    (stock makes one a tensor): ``x * 0`` is NaN exactly where ``x`` is not finite, and a 1-norm
    propagates NaN (an inf-norm of ``x`` itself may drop NaN in a max)."""
    state = {k: v.detach() for k, v in ema.state_dict(keep_vars=True).items()
             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()}
    if not state:
        return
    with torch.no_grad():
        sums = torch._foreach_norm(torch._foreach_mul(list(state.values()), 0.0), 1)
    finite = torch.stack(sums).isfinite().tolist()
    if all(finite):
        return
    model_state = model.state_dict()
    for (k, v), ok in zip(state.items(), finite):
        if not ok:
            source = model_state[k]
            v.copy_(torch.where(source.isfinite().all(), source, v))


def copies_of(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """``id(t)`` -> a copy of ``t`` (same dtype, device and strides, no grad) for each of ``tensors``,
    in one multi-tensor launch per device and dtype."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():
        groups.setdefault((t.device, t.dtype), []).append(t)
    out = {}
    with torch.no_grad():
        for group in groups.values():
            made = [torch.empty_like(t) for t in group]
            torch._foreach_copy_(made, group)
            out.update((id(t), c) for t, c in zip(group, made))
    return out


@dataclasses.dataclass
class Snapshot:
    """A checkpoint taken on the training thread. Its ``ema`` and ``optimizer`` entries are the live
    EMA module and the optimizer's state dict (its containers copied) until :func:`serialize`
    deep-copies them through ``memo`` (``id`` of each live tensor -> its copy) and sets ``copied``;
    the copies are on ``device`` (``copies``, kept until the write is done), complete once ``ready``
    (an event on that CUDA device; None where the copies are done)."""

    checkpoint: dict[str, Any]
    device: torch.device
    copies: list[torch.Tensor]
    memo: dict[int, Any]
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    ready: torch.cuda.Event | None = None


def snapshot(trainer: Any) -> Snapshot:
    """The checkpoint ``BaseTrainer.save_model`` writes for ``trainer``, its params, buffers and
    optimizer state copied in a few multi-tensor launches (:func:`serialize` deep-copies the rest)."""
    ema = trainer.ema.ema
    resync_non_finite(ema, unwrap_model(trainer.model))
    live = list(ema.parameters()) + list(ema.buffers())
    optimizer = trainer.optimizer.state_dict()
    # the per-param state dicts may be the optimizer's own, changed by its next steps
    optimizer = {**optimizer, "state": {k: dict(v) for k, v in optimizer["state"].items()}}
    copies = copies_of(live + [v for state in optimizer["state"].values() for v in state.values()
                               if isinstance(v, torch.Tensor)])
    memo: dict[int, Any] = dict(copies)
    memo.update((id(p), type(p)(copies[id(p)], p.requires_grad)) for p in ema.parameters())
    checkpoint = {
        "epoch": trainer.epoch,
        "best_fitness": trainer.best_fitness,
        "stopper": {"best_fitness": trainer.stopper.best_fitness, "best_epoch": trainer.stopper.best_epoch},
        "model": None,
        "ema": ema,  # the live module until serialize copies it through memo
        "updates": trainer.ema.updates,
        "modelopt": None,  # a quantization-aware EMA is saved by ultralytics (why_no_snapshot)
        "optimizer": optimizer,
        "scaler": trainer.scaler.state_dict(),
        "train_args": dict(vars(trainer.args)),  # the run may change its args before the write
        "train_metrics": {**trainer.metrics, "fitness": trainer.fitness},
        "train_results": _csv_bytes(trainer.csv),  # parsed in the writer thread (results_table)
        "date": datetime.now().astimezone().isoformat(),
        "version": __version__,
        "git": {"root": str(GIT.root), "branch": GIT.branch, "commit": GIT.commit, "message": GIT.message,
                "origin": GIT.origin},
        "license": "AGPL-3.0 (https://ultralytics.com/license)",
        "docs": "https://docs.ultralytics.com",
    }
    taken = Snapshot(checkpoint, trainer.device, list(copies.values()), memo)
    if trainer.device.type == "cuda":
        taken.ready = torch.cuda.Event()
        taken.ready.record(torch.cuda.current_stream(trainer.device))
    return taken


def _csv_bytes(path: Path) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


def results_table(data: bytes | None) -> dict:
    """``BaseTrainer.read_results_csv`` of a results.csv read earlier (``data``, None when it could
    not be read): its columns as lists, or {} where polars cannot parse it. Parsed in the writer
    thread: the first call imports polars, a second or more on the training thread otherwise."""
    import polars as pl

    if data is None:
        return {}
    try:
        return pl.read_csv(data, infer_schema_length=None).to_dict(as_series=False)
    except Exception:  # noqa: BLE001 - stock's read gives {} for any failure
        return {}


def copy_structure(taken: Snapshot) -> None:
    """Replace the live EMA module and optimizer state of ``taken`` by deep copies made through its
    memo (each live tensor by its copy), then set ``taken.copied``, whether the copy worked or not."""
    try:
        checkpoint, memo = taken.checkpoint, taken.memo
        checkpoint["ema"] = deepcopy(checkpoint["ema"], memo)
        checkpoint["optimizer"] = deepcopy(checkpoint["optimizer"], memo)
    finally:
        taken.copied.set()


def serialize(taken: Snapshot, *, torch_layout: bool) -> bytes:
    """The bytes of a :func:`snapshot` (in the writer thread: its structure copied first, then on
    CUDA once its copies are done, on a side stream so the casts and device-to-host copies overlap
    the training stream's work), the EMA and the optimizer state converted as stock converts them."""
    if not taken.copied.is_set():
        copy_structure(taken)
    if taken.ready is None:
        return _dumps(taken.checkpoint, torch_layout)
    # its copies to the host are syncs: none while the training thread watches a call for its own
    with background_syncs, torch.cuda.device(taken.device):
        side = torch.cuda.Stream()
        side.wait_event(taken.ready)
        with torch.cuda.stream(side):
            data = _dumps(taken.checkpoint, torch_layout)
        side.synchronize()  # the copies' memory goes back to the training stream's pool after this
    return data


def _dumps(checkpoint: dict[str, Any], torch_layout: bool) -> bytes:
    # stock's conversions: NCHW whatever the training's memory format, no training-only state,
    # fp16 overflow clamped
    ema = checkpoint["ema"].half().to(memory_format=torch.contiguous_format)
    if hasattr(ema, "criterion"):
        ema.criterion = None
    for v in ema.state_dict().values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            torch.nan_to_num_(v)
    optimizer = torch_state_dict(checkpoint["optimizer"]) if torch_layout else checkpoint["optimizer"]
    optimizer = convert_optimizer_state_dict_to_fp16(optimizer)
    buffer = io.BytesIO()
    torch.save({**checkpoint, "ema": ema, "optimizer": optimizer,
                "train_results": results_table(checkpoint["train_results"])}, buffer)
    return buffer.getvalue()


def targets(trainer: Any) -> list[Path]:
    """The files stock's save writes this epoch: last.pt; best.pt when the epoch's fitness is the
    best; epochN.pt every ``save_period`` epochs."""
    paths = [trainer.last]
    if trainer.best_fitness == trainer.fitness:
        paths.append(trainer.best)
    if trainer.save_period > 0 and trainer.epoch % trainer.save_period == 0:
        paths.append(trainer.wdir / f"epoch{trainer.epoch}.pt")
    return paths


__all__ = ["PARTIAL_SUFFIX", "CheckpointWriteError", "CheckpointWriter", "Snapshot", "copies_of",
           "copy_structure", "reads_checkpoint", "resync_non_finite", "serialize", "snapshot", "targets",
           "why_no_snapshot", "write_atomically"]
