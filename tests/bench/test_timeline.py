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


def test_a_cut_off_default_run_bench_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """The runs' parts are written as each finishes: a bench stopped by a time limit during its
    third run leaves the first two (the table and report come only at the end)."""
    import argparse
    import json

    from trainfuse.bench import yolo_default

    finished = []

    def spawn(kind, data, epochs, project, name, *rest):
        if len(finished) == 2:
            raise KeyboardInterrupt("time limit")
        finished.append(name)
        return {"wall": 10.0 + len(finished), **{p: 1.0 for p in PARTS}, "map50_95": 0.5}

    monkeypatch.setattr(yolo_default, "_spawn", spawn)
    monkeypatch.setattr(yolo_default, "_forget_labels", lambda data: None)
    args = argparse.Namespace(epochs=1, images=4, val_images=2, seed=0, stock_warm=False,
                              parallel_plots=False)
    with pytest.raises(KeyboardInterrupt):
        yolo_default.run({}, args, str(tmp_path / "data.yaml"), tmp_path / "out", "8")
    runs = json.loads((tmp_path / "out" / yolo_default.PARTIAL).read_text())
    assert list(runs) == ["stock", "trainfuse-cold"] == finished
    assert runs["trainfuse-cold"]["wall"] == 12.0 and runs["stock"]["setup"] == 1.0
