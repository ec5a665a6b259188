"""The photo benchmark's pieces on the CPU: photo-like JPEGs of a photo's size, 4:3, their labels
inside the image; ultralytics' training loader alone timed per epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ultralytics")
cv2 = pytest.importorskip("cv2")

from trainfuse.bench.yolo_photo import loader_rates  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402


def test_photo_jpegs_have_a_photos_size_and_shape(tmp_path):
    yaml = make_shapes_dataset(tmp_path / "p", n_train=3, n_val=1, imgsz=640, photo=True)
    root = Path(yaml).parent
    jpegs = sorted((root / "images" / "train").glob("*.jpg"))
    assert len(jpegs) == 3
    kb = np.mean([p.stat().st_size for p in jpegs]) / 1024
    assert 120 < kb < 260, kb  # COCO's mean is about 160-195 KB at this size
    assert cv2.imread(str(jpegs[0])).shape == (480, 640, 3)
    for label in (root / "labels" / "train").glob("*.txt"):
        rows = np.loadtxt(label, ndmin=2)
        xc, yc, w, h = rows[:, 1:].T
        assert ((xc - w / 2 >= 0) & (xc + w / 2 <= 1) & (yc - h / 2 >= 0) & (yc + h / 2 <= 1)).all()
    square = make_shapes_dataset(tmp_path / "s", n_train=1, n_val=1, imgsz=64)
    first = next((Path(square).parent / "images" / "train").glob("*.jpg"))
    assert cv2.imread(str(first)).shape == (64, 64, 3)


def test_the_loader_alone_is_timed_per_epoch(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    yaml = make_shapes_dataset(tmp_path / "p", n_train=8, n_val=2, imgsz=64, photo=True)
    rates = loader_rates(str(yaml), imgsz=64, batch=4, workers=0, epochs=2)
    assert len(rates) == 2 and all(r > 0 for r in rates)


def test_the_deferred_loader_alone_hands_over_crops(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    yaml = make_shapes_dataset(tmp_path / "p", n_train=8, n_val=2, imgsz=64, photo=True)
    rates = loader_rates(str(yaml), imgsz=64, batch=4, workers=0, epochs=1, deferred=True)
    assert len(rates) == 1 and rates[0] > 0


def test_the_steady_rate_starts_after_the_first_epoch_and_counts_the_epoch_ends():
    from trainfuse.bench.yolo_harness import LoopTimer

    timer = LoopTimer()
    clock = 0.0
    for epoch in range(3):
        clock += 5.0 if epoch == 0 else 1.0  # warm-up, then each epoch's end (a checkpoint)
        for i in range(4):  # the first 2 of an epoch made ahead while it ended: no wait
            clock += 0.0 if i < 2 else 0.3
            timer.starts.append(clock)
            timer.epoch_of.append(epoch)
            clock += 0.1
            timer.ends.append(clock)
    # epochs 1 and 2: 8 iterations of 0.1 s, 4 waits of 0.3 s and 2 epoch ends of 1 s
    assert timer.steady_images_per_s(batch=8) == pytest.approx(8 * 8 / (8 * 0.1 + 4 * 0.3 + 2 * 1.0))
    one = LoopTimer()
    one.starts, one.ends, one.epoch_of = [0.0, 1.0], [0.5, 1.5], [0, 0]
    assert np.isnan(one.steady_images_per_s(batch=8))


def test_a_large_photo_set_copies_its_first_drawn_images(tmp_path):
    yaml = make_shapes_dataset(tmp_path / "p", n_train=5, n_val=1, imgsz=64, photo=True, distinct=2)
    root = Path(yaml).parent
    jpegs = sorted((root / "images" / "train").glob("*.jpg"))
    assert len(jpegs) == 5 and jpegs[0].read_bytes() != jpegs[1].read_bytes()
    for i in range(2, 5):  # image i is image i % 2, its labels too
        assert jpegs[i].read_bytes() == jpegs[i % 2].read_bytes()
        assert ((root / "labels" / "train" / f"{i:05d}.txt").read_text()
                == (root / "labels" / "train" / f"{i % 2:05d}.txt").read_text())
    with pytest.raises(ValueError, match="distinct=0; expected at least 1 or None"):
        make_shapes_dataset(tmp_path / "q", n_train=5, n_val=1, imgsz=64, photo=True, distinct=0)


def test_an_unsynced_timer_times_the_host_and_reads_no_loss():
    """The photo benchmark's loops run as a user's: no sync and no loss read at each iteration."""
    import torch

    from trainfuse.bench.yolo_harness import LoopTimer

    class Trainer:
        device, epoch, batch_size = torch.device("cpu"), 0, 8

        @property
        def loss(self):
            raise LookupError("the loss was read")

    trainer, timer = Trainer(), LoopTimer(sync=False)
    timer.on_train_epoch_start(trainer)
    for _ in range(3):
        timer.on_train_batch_start(trainer)
        timer.on_train_batch_end(trainer)
    timer.on_train_epoch_end(trainer)
    assert len(timer.starts) == len(timer.ends) == 3 and timer.losses == [] and len(timer.epoch_s) == 1
    summary = timer.summary(batch=8, warmup=0)
    assert summary["iterations"] == 3 and np.isnan(summary["images_per_s"])  # host times give no rate
    with pytest.raises(LookupError, match="the loss was read"):  # the synced timer reads it
        LoopTimer().on_train_batch_end(trainer)


def test_the_last_epochs_iteration_is_its_wall_time_over_its_iterations():
    """What an unsynced run compares: the last epoch's time (the GPU waited for at its ends) over
    its own iterations, not the first epoch's (captures, compiles) nor the run's."""
    from trainfuse.bench.yolo_harness import LoopTimer

    timer = LoopTimer(sync=False)
    timer.epoch_s = [9.0, 1.2]
    timer.epoch_of = [0] * 5 + [1] * 4
    timer.starts = timer.ends = [float(i) for i in range(9)]
    assert timer.summary(batch=8, warmup=0)["last_epoch_iter_ms"] == pytest.approx(1.2e3 / 4)
    assert np.isnan(LoopTimer().summary(batch=8)["last_epoch_iter_ms"])  # no epoch timed
