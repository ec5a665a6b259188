"""The default-run benchmark's timeline on a real (tiny, CPU) ultralytics run: its parts add up
to the run's wall clock, one validation per epoch plus the final one, and the benchmark's child
process writes what the parent reads."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("ultralytics")

from trainfuse.bench.timeline import Timeline  # noqa: E402
from trainfuse.bench.yolo_default import PARTS, one_run  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402


@pytest.mark.cpu_training
def test_parts_add_up_to_the_wall_clock_of_a_default_run(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    data = make_shapes_dataset(tmp_path / "d", n_train=4, n_val=2, imgsz=64)
    from ultralytics import YOLO

    model = YOLO("yolov5n.yaml")
    timeline = Timeline().attach(model)
    timeline.start()
    model.train(data=str(data), epochs=2, imgsz=64, batch=2, workers=0, project=str(tmp_path / "runs"),
                name="t", exist_ok=True, plots=False, device="cpu")
    timeline.stop()
    parts = timeline.parts()
    assert math.isclose(sum(parts[p] for p in PARTS), parts["wall"], rel_tol=1e-9, abs_tol=1e-9)
    assert all(parts[p] >= 0 for p in PARTS), parts
    assert len(parts["epochs"]) == 2 and len(parts["epoch_total"]) == 2
    assert len(parts["validations"]) == 3  # one per epoch, then the final evaluation of best.pt
    assert parts["validation"] == pytest.approx(sum(parts["validations"][:2]))
    assert parts["final"] >= parts["validations"][2]
    assert len(parts["saves"]) == 2 and all(0 <= t <= parts["epoch_ends"] for t in parts["saves"])


def test_one_run_reports_its_parts_and_maps(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    data = make_shapes_dataset(tmp_path / "d", n_train=2, n_val=1, imgsz=64)
    import ultralytics.cfg

    # the default run's arguments at a tiny size: imgsz, batch and workers are the defaults' only changes
    monkeypatch.setattr(ultralytics.cfg.DEFAULT_CFG, "imgsz", 64)
    monkeypatch.setattr(ultralytics.cfg.DEFAULT_CFG, "batch", 2)
    monkeypatch.setattr(ultralytics.cfg.DEFAULT_CFG, "workers", 0)
    monkeypatch.setattr(ultralytics.cfg.DEFAULT_CFG, "device", "cpu")
    result = one_run("stock", str(data), 1, str(tmp_path / "runs"), "s")
    json.dumps(result)  # what the child process hands the parent
    assert set(PARTS) <= set(result) and {"map50", "map50_95"} <= set(result)
    assert math.isclose(sum(result[p] for p in PARTS), result["wall"], rel_tol=1e-9)
