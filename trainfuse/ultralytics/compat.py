"""Every private name of ultralytics the integration relies on, in one place.

Each entry says what it reads or overrides, why no public name does the job, and is pinned by a
test against the installed version (``tests/ultralytics/test_compat.py``); the layering test
(``tests/test_layering.py``) refuses an override or read of an ultralytics private name anywhere
else. :data:`TESTED_VERSIONS` are the ultralytics releases the suite ran against; another version
gets one clear warning (:func:`warn_if_untested`).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import ultralytics
from typing_extensions import override

TESTED_VERSIONS = ("8.4.190",)

# ultralytics' loop steps the optimizer where this line of ``BaseTrainer._do_train`` says, and
# restarts ``last_opt_step`` at -1 (its start, an OOM retry, a NaN recovery): a local variable, so
# the fused phase's place in the step's graphs counts iterations itself (GraphedLoss) and this
# rule is checked once, before training, in the loop's source (:func:`why_not_stepping_rule`)
STEPPING_RULE = "if ni - last_opt_step >= self.accumulate:"
_warned: set[str] = set()


def warn_if_untested() -> None:
    """Warn once per process when the installed ultralytics is not one of :data:`TESTED_VERSIONS`."""
    version = ultralytics.__version__
    if version in TESTED_VERSIONS or version in _warned:
        return
    _warned.add(version)
    warnings.warn(f"trainfuse.ultralytics is tested with ultralytics {', '.join(TESTED_VERSIONS)}; this "
                  f"is {version}. It relies on the private names in trainfuse/ultralytics/compat.py: if "
                  "training fails or differs from stock, train with ultralytics' own trainer (leave out "
                  "trainer=)",
                  RuntimeWarning, stacklevel=3)


class TrainerHooks:
    """Three private methods of ultralytics' ``BaseTrainer``, overridden here only, each handing over
    to a public hook of the subclass:

    - ``_setup_train`` (no public hook runs after it: ``on_pretrain_routine_end`` fires inside,
      before ``resume_training`` has loaded a checkpoint's optimizer state) -> :meth:`after_setup`,
      once model, loaders, optimizer, scaler and EMA exist and a resume is loaded;
    - ``_load_checkpoint_state`` (resume and NaN recovery both load through it, mid-training for
      the latter) -> :meth:`around_checkpoint_load`, given the load to run;
    - ``_handle_nan_recovery`` (every epoch end, after validation: on NaN/Inf it reads last.pt, on
      every rank, before ``_load_checkpoint_state``) -> :meth:`before_checkpoint_read` first, as
      ``final_eval`` (reads and rewrites last.pt and best.pt) does.
    """

    def after_setup(self) -> None:
        """The training setup is complete (the subclass makes its changes here)."""

    def around_checkpoint_load(self, load: Callable[[], None]) -> None:
        """Run ``load``, the stock load of a checkpoint's optimizer, scaler and EMA state."""
        load()

    def before_checkpoint_read(self) -> None:
        """ultralytics may read this run's checkpoint files next (the subclass finishes its writes)."""

    @override
    def final_eval(self) -> None:
        self.before_checkpoint_read()
        super().final_eval()

    @override
    def _handle_nan_recovery(self, epoch: int) -> bool:
        self.before_checkpoint_read()
        return super()._handle_nan_recovery(epoch)

    @override
    def _setup_train(self) -> None:
        super()._setup_train()
        self.after_setup()

    @override
    def _load_checkpoint_state(self, ckpt: dict) -> None:
        self.around_checkpoint_load(lambda: super(TrainerHooks, self)._load_checkpoint_state(ckpt))


def why_not_stepping_rule(trainer_cls: type) -> str | None:
    """Why the training loop of ``trainer_cls`` may not step the optimizer by :data:`STEPPING_RULE`
    (then nothing may predict its steps), or None where its ``_do_train`` is ultralytics' own
    loop with that rule."""
    try:
        source = inspect.getsource(trainer_cls._do_train)
    except (OSError, TypeError, AttributeError) as e:
        return f"the training loop's source cannot be read ({e})"
    if STEPPING_RULE not in source or source.count("last_opt_step = -1") < 3:
        return (f"{trainer_cls.__name__}._do_train does not step the optimizer by ultralytics 8.4's rule "
                f"({STEPPING_RULE!r}, restarted at -1 on start, OOM and NaN recovery)")
    return None


# ---- the training transforms' parameters (``get_params`` results, read by the deferred transforms)
def mosaic_tiles(params: dict) -> list[tuple]:
    """``Mosaic.get_params``'s layout of 4 as ``(image, x1a, y1a, x2a, y2a, x1b, y1b)`` per tile: the
    tile's pixels and where they go on the canvas (``a``) from where in the image (``b``)."""
    return [(t["labels_patch"]["img"], t["x1a"], t["y1a"], t["x2a"], t["y2a"], t["x1b"], t["y1b"])
            for t in params["layout"]]


def perspective_matrix(params: dict) -> Any:
    """``RandomPerspective.get_params``'s 3 x 3 warp matrix (numpy)."""
    return params["M"]


def perspective_size(params: dict) -> tuple[int, int]:
    """``RandomPerspective.get_params``'s output size ``(w, h)``."""
    return tuple(int(v) for v in params["size"])


def flip_of(params: dict) -> tuple[bool, bool]:
    """``RandomFlip.get_params``'s draw: ``(vertical, flipped)``."""
    return params["direction"] == "vertical", bool(params["flip"])


def retyped(obj: Any, cls: type) -> Any:
    """A shallow copy of ``obj`` (a transform) as an instance of ``cls`` (a subclass of its class
    that overrides methods only): ultralytics' transforms keep their state in instance attributes
    that no public constructor argument sets back (the hyperparameters already resolved)."""
    new = cls.__new__(cls)
    new.__dict__.update(obj.__dict__)
    return new


# ---- the dataset's image loading (``BaseDataset.load_image``), for images decoded on the GPU ------
def resized_shape(dataset: Any, h0: int, w0: int, rect_mode: bool, resize_short: bool) -> tuple[int, int]:
    """The (h, w) ``BaseDataset.load_image`` resizes an (h0, w0) image to."""
    size = dataset.imgsz
    shape = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    imgsz = max(shape)
    if not rect_mode:
        return shape if (h0, w0) != shape else (h0, w0)
    if resize_short:
        r = imgsz / min(h0, w0)
        if r != 1:
            return (imgsz, math.ceil(w0 * r)) if h0 < w0 else (math.ceil(h0 * r), imgsz)
        return h0, w0
    r = imgsz / max(h0, w0)
    if r != 1:
        return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)
    return h0, w0


def keep_loaded(dataset: Any, i: int, im: Any, hw0: tuple[int, int], hw: tuple[int, int]) -> None:
    """What ``BaseDataset.load_image`` keeps of image ``i`` for the mosaic's later draws when the
    dataset augments from disk: the image in ``ims`` and its index in ``buffer``, the oldest
    dropped once ``max_buffer_length`` is reached."""
    if not dataset.augment or dataset.cache == "ram":
        return
    dataset.ims[i], dataset.im_hw0[i], dataset.im_hw[i] = im, hw0, hw
    dataset.buffer.append(i)
    if 1 < len(dataset.buffer) >= dataset.max_buffer_length:
        j = dataset.buffer.pop(0)
        dataset.ims[j], dataset.im_hw0[j], dataset.im_hw[j] = None, None, None


# ---- the validation loader's workers -------------------------------------------------------------
class _Niced:
    """A DataLoader ``worker_init_fn``: the loader's own (None: none), then ``os.nice(by)``."""

    def __init__(self, init: Callable[[int], None] | None, by: int) -> None:
        self.init, self.by = init, by

    def __call__(self, worker_id: int) -> None:
        if self.init is not None:
            self.init(worker_id)
        if hasattr(os, "nice"):
            os.nice(self.by)


def start_workers(loader: Any, nice: int = 0) -> bool:
    """Fork the workers of ultralytics' ``InfiniteDataLoader`` ``loader`` now, each lowered in
    priority by ``nice`` (``os.nice``, after the loader's own ``worker_init_fn``). The loader forks
    them at its first iteration (its ``iterator`` is None until then) and keeps that iterator
    across passes; the one made here is the one its ``__iter__`` then reads, through
    ``DataLoader.__iter__``, as its own first iteration would. False (nothing done) for another
    loader, one without workers, or one whose workers run already."""
    from torch.utils.data import DataLoader
    from ultralytics.data.build import InfiniteDataLoader

    if not isinstance(loader, InfiniteDataLoader) or loader.num_workers == 0 or loader.iterator is not None:
        return False
    init = loader.worker_init_fn
    if nice:
        loader.worker_init_fn = _Niced(init, nice)
    try:
        loader.iterator = DataLoader.__iter__(loader)
    finally:
        loader.worker_init_fn = init  # a later reset() forks them as ultralytics would
    return True


__all__ = ["STEPPING_RULE", "TESTED_VERSIONS", "TrainerHooks", "flip_of", "keep_loaded", "mosaic_tiles",
           "perspective_matrix", "perspective_size", "resized_shape", "retyped", "start_workers",
           "warn_if_untested", "why_not_stepping_rule"]
