"""Every entry of trainfuse/ultralytics/compat.py against the installed ultralytics: each test fails
when ultralytics changes what the entry relies on."""

from __future__ import annotations

import inspect
import os
import random
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("ultralytics")

import ultralytics  # noqa: E402
from ultralytics.data.augment import Mosaic, RandomFlip, RandomHSV, RandomPerspective  # noqa: E402
from ultralytics.data.base import BaseDataset  # noqa: E402
from ultralytics.engine.trainer import BaseTrainer  # noqa: E402
from ultralytics.utils.instance import Instances  # noqa: E402

from trainfuse.ultralytics import compat  # noqa: E402


def test_the_trainer_hooks_override_methods_ultralytics_calls_as_they_say():
    """``_setup_train`` takes no argument and loads a resumed checkpoint before it returns;
    ``_load_checkpoint_state`` takes the checkpoint and is how resume and NaN recovery load."""
    assert list(inspect.signature(BaseTrainer._setup_train).parameters) == ["self"]
    assert list(inspect.signature(BaseTrainer._load_checkpoint_state).parameters) == ["self", "ckpt"]
    assert "self.resume_training(ckpt)" in inspect.getsource(BaseTrainer._setup_train)
    assert "self._setup_train()" in inspect.getsource(BaseTrainer._do_train)
    for caller in (BaseTrainer.resume_training, BaseTrainer._handle_nan_recovery):
        assert "self._load_checkpoint_state(ckpt)" in inspect.getsource(caller)


def test_nan_recovery_and_final_eval_are_the_loops_only_checkpoint_reads():
    """``_handle_nan_recovery(epoch)`` runs at every epoch end of the loop and reads last.pt (before
    ``_load_checkpoint_state``); ``final_eval`` reads and rewrites last.pt and best.pt; no other
    method of the trainer loads a checkpoint file of the run mid-training."""
    assert list(inspect.signature(BaseTrainer._handle_nan_recovery).parameters) == ["self", "epoch"]
    assert "if self._handle_nan_recovery(epoch):" in inspect.getsource(BaseTrainer._do_train)
    recovery = inspect.getsource(BaseTrainer._handle_nan_recovery)
    assert recovery.index("load_checkpoint(self.last)") < recovery.index("self._load_checkpoint_state(ckpt)")
    final = inspect.getsource(BaseTrainer.final_eval)
    assert "strip_optimizer(self.last)" in final and "strip_optimizer(self.best" in final
    readers = [name for name, fn in vars(BaseTrainer).items() if callable(fn) and name != "check_resume"
               and any(f"{call}(self.{path}" in inspect.getsource(fn) for call in ("load_checkpoint",
                       "strip_optimizer", "torch_load") for path in ("last", "best"))]
    assert sorted(readers) == ["_handle_nan_recovery", "final_eval"]


def test_the_stepping_rule_is_the_loops_and_another_loop_is_told():
    assert compat.why_not_stepping_rule(BaseTrainer) is None

    class OtherLoop(BaseTrainer):
        def _do_train(self):  # steps every iteration
            self.optimizer_step()

    why = compat.why_not_stepping_rule(OtherLoop)
    assert why.startswith("OtherLoop._do_train does not step the optimizer by ultralytics 8.4's rule")


def test_an_untested_version_warns_once(monkeypatch):
    monkeypatch.setattr(ultralytics, "__version__", "99.0.0")
    monkeypatch.setattr(compat, "_warned", set())
    with pytest.warns(RuntimeWarning, match="tested with ultralytics .*; this is 99.0.0"):
        compat.warn_if_untested()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested()  # once only
    monkeypatch.setattr(ultralytics, "__version__", compat.TESTED_VERSIONS[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested()


def _labels(h: int, w: int) -> dict:
    boxes = np.array([[0.2, 0.2, 0.6, 0.7]], dtype=np.float32)
    return {"img": np.zeros((h, w, 3), np.uint8), "cls": np.zeros((1, 1), np.float32),
            "instances": Instances(boxes, bbox_format="xyxy", normalized=True), "resized_shape": (h, w)}


def test_the_transforms_parameters_read_as_compat_names_them():
    random.seed(0)
    flip = RandomFlip(p=1.0, direction="vertical")
    assert compat.flip_of(flip.get_params(_labels(32, 48))) == (True, True)
    assert compat.flip_of(RandomFlip(p=0.0).get_params(_labels(32, 48))) == (False, False)
    warp = RandomPerspective(degrees=5.0, translate=0.1, scale=0.5)
    params = warp.get_params(_labels(32, 48))
    assert compat.perspective_matrix(params).shape == (3, 3)
    assert compat.perspective_size(params) == (48, 32)
    source = SimpleNamespace(buffer=[0, 1, 2], cache=None, get_image_and_label=lambda i: _labels(32, 32))
    mosaic = Mosaic(source, imgsz=32, p=1.0, n=4)
    labels = _labels(32, 32) | {"mix_labels": [_labels(32, 32) for _ in range(3)]}
    tiles = compat.mosaic_tiles(mosaic.get_params(labels))
    assert len(tiles) == 4 and tiles[0][0] is labels["img"]
    assert all(len(t) == 7 and t[3] > t[1] and t[4] > t[2] for t in tiles)  # (img, x1a, y1a, x2a, y2a, ...)


def test_a_retyped_transform_keeps_its_settings():
    class Quiet(RandomHSV):
        pass

    hsv = RandomHSV(hgain=0.1, sgain=0.2, vgain=0.3)
    quiet = compat.retyped(hsv, Quiet)
    assert type(quiet) is Quiet and (quiet.hgain, quiet.sgain, quiet.vgain) == (0.1, 0.2, 0.3)


@pytest.mark.parametrize("rect_mode,resize_short", [(True, False), (True, True), (False, False)])
def test_resized_shape_and_kept_images_are_load_images(tmp_path, rect_mode, resize_short):
    """``BaseDataset.load_image`` itself on images of several shapes: the shape it resizes to, and
    what it keeps for the mosaic (``keep_loaded`` on a twin dataset keeps the same)."""
    import cv2

    shapes = [(40, 64), (64, 40), (64, 64), (20, 30), (96, 50)]
    files = []
    for k, (h, w) in enumerate(shapes):
        files.append(tmp_path / f"{k}.jpg")
        cv2.imwrite(str(files[-1]), np.full((h, w, 3), 40 * k, np.uint8))

    def dataset():
        n = len(files)
        return SimpleNamespace(ims=[None] * n, im_hw0=[None] * n, im_hw=[None] * n,
                               im_files=[str(f) for f in files],
                               npy_files=[f.with_suffix(".npy") for f in files], cache=None, channels=3,
                               cv2_flag=cv2.IMREAD_COLOR, imgsz=48, augment=True, buffer=[],
                               max_buffer_length=3, prefix="")

    stock, ours = dataset(), dataset()
    for i, (h0, w0) in enumerate(shapes):
        im, hw0, hw = BaseDataset.load_image(stock, i, rect_mode, resize_short)
        assert hw0 == (h0, w0) and hw == im.shape[:2]
        assert compat.resized_shape(ours, h0, w0, rect_mode, resize_short) == hw
        compat.keep_loaded(ours, i, im, hw0, hw)
        assert ours.buffer == stock.buffer
        assert [x is None for x in ours.ims] == [x is None for x in stock.ims]
        assert ours.im_hw0 == stock.im_hw0 and ours.im_hw == stock.im_hw


class _Priority(torch.utils.data.Dataset):
    """Item i: (i, the niceness of the process that loads it)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return i, os.nice(0)


def test_start_workers_forks_an_infinite_loaders_workers_and_its_passes_read_them():
    from ultralytics.data.build import InfiniteDataLoader

    inits = []

    def loader(workers: int, dataset=None):
        return InfiniteDataLoader(dataset=dataset or list(range(10)), batch_size=3, num_workers=workers,
                                  worker_init_fn=inits.append)

    stock, early = loader(2), loader(2)
    assert early.iterator is None  # ultralytics forks at the first iteration
    assert compat.start_workers(early) and early.iterator is not None
    assert not compat.start_workers(early)  # running already
    for _ in range(2):  # two passes (epochs) over the one iterator, as ultralytics' own
        assert [b.tolist() for b in early] == [b.tolist() for b in stock]
    niced = loader(2, _Priority())
    assert compat.start_workers(niced, nice=3) and niced.worker_init_fn == inits.append
    items, priority = (torch.cat(x).tolist() for x in zip(*niced))
    assert items == list(range(10)) and set(priority) == {os.nice(0) + 3}
    niced.close()
    for other in (loader(0), torch.utils.data.DataLoader(list(range(4)), num_workers=2)):
        assert not compat.start_workers(other)
    for running in (stock, early):
        running.close()
