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
    # as a DDP rank zero records them for the process that called train() (module docstring)
    monkeypatch.setenv("RANK", "0")
    timeline = Timeline(share=tmp_path / "moments.json").attach(model)
    timeline.start()
    model.train(data=str(data), epochs=2, imgsz=64, batch=2, workers=0, project=str(tmp_path / "runs"),
                name="t", exist_ok=True, plots=False, device="cpu")
    timeline.stop()
    parts = timeline.parts()
    caller = Timeline(share=tmp_path / "moments.json")  # its own callbacks never ran
    caller.t0, caller.t1 = timeline.t0, timeline.t1
    caller.stop()
    caller.t1 = timeline.t1
    assert caller.marks == timeline.marks and caller.parts() == parts
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


def _stub_runs(monkeypatch, walls):
    from trainfuse.bench import yolo_default

    def spawn(kind, data, epochs, project, name, *rest):
        return {"wall": walls[name], **{p: 1.0 for p in PARTS}, "map50_95": 0.5}

    monkeypatch.setattr(yolo_default, "_spawn", spawn)
    monkeypatch.setattr(yolo_default, "_forget_labels", lambda data: None)
    return yolo_default


def _args(**kw):
    import argparse

    return argparse.Namespace(**{"epochs": 100, "images": 1024, "val_images": 256, "seed": 0,
                                 "stock_warm": False, "parallel_plots": False, "runs": None, "previous": None,
                                 **kw})


def test_a_long_run_is_measured_in_parts_on_one_machine(tmp_path, monkeypatch):
    """``--runs stock`` in one command, ``--runs trainfuse-cold --previous <partial>`` in the next:
    the second report holds both runs and the cold ratio against the 100-epoch goal (4.5x)."""
    import json

    bench = _stub_runs(monkeypatch, {"stock": 450.0, "trainfuse-cold": 90.0, "trainfuse-warm": 80.0})
    first: dict = {"rows": []}
    bench.run(first, _args(runs="stock"), str(tmp_path / "data.yaml"), tmp_path / "a", "8")
    partial = tmp_path / "a" / bench.PARTIAL
    assert list(json.loads(partial.read_text())) == ["stock"] and "goals" not in first
    assert any("only stock ran" in n for n in first["notes"])
    second: dict = {"rows": []}
    bench.run(second, _args(runs="trainfuse-cold", previous=str(partial)), str(tmp_path / "data.yaml"),
              tmp_path / "b", "8")
    assert list(second["runs"]) == ["stock", "trainfuse-cold"]
    assert {r["machine"] for r in second["runs"].values()} == {bench.machine_id()}
    assert second["goals"] == {"cold_speedup": True, "first_step_cold": True}
    assert second["goal_values"]["cold_speedup"] == 4.5
    assert [r["impl"] for r in second["rows"]] == ["ultralytics DetectionTrainer", "FusedDetectionTrainer"]
    assert bench.family_of(_args()) == "yolo-default-run-100-epochs-1024-images"
    assert bench.family_of(_args(epochs=20, images=2048, val_images=512)) == "yolo-default-run"
    assert bench.family_of(_args(epochs=20, images=2048, val_images=512, devices="0,1")) == \
        "yolo-default-run-2gpus"


def test_several_devices_train_every_run_on_them(tmp_path, monkeypatch):
    from trainfuse.bench import yolo_default

    devices = []

    def spawn(kind, data, epochs, project, name, env, seed, plots, device):
        devices.append(device)
        return {"wall": 10.0, **{p: 1.0 for p in PARTS}, "map50_95": 0.5}

    monkeypatch.setattr(yolo_default, "_spawn", spawn)
    monkeypatch.setattr(yolo_default, "_forget_labels", lambda data: None)
    report: dict = {"rows": []}
    yolo_default.run(report, _args(devices="0,1"), "data.yaml", tmp_path / "o", "8")
    assert devices == ["0,1"] * 3 and report["settings"]["devices"] == "0,1"
    assert "device=0,1 (DDP, 16 images a step over the 2 GPUs)" in report["rows"][0]["workload"]
    yolo_default.run({"rows": []}, _args(devices="0"), "data.yaml", tmp_path / "o", "8")
    assert devices[3:] == [""] * 3  # one GPU: ultralytics' own default device


def test_runs_of_another_machine_or_a_warm_run_alone_are_refused(tmp_path, monkeypatch):
    import json

    bench = _stub_runs(monkeypatch, {})
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"stock": {"wall": 1.0, "machine": "another-boot"}}))
    with pytest.raises(SystemExit, match="holds runs of another machine or boot"):
        bench.run({}, _args(runs="trainfuse-cold", previous=str(other)), "data.yaml", tmp_path / "o", "8")
    with pytest.raises(SystemExit, match="trainfuse-warm runs after trainfuse-cold in the same command"):
        bench.run({}, _args(runs="stock,trainfuse-warm"), "data.yaml", tmp_path / "o", "8")
    with pytest.raises(SystemExit, match="--runs takes names among stock, trainfuse-cold"):
        bench.run({}, _args(runs="stock,nope"), "data.yaml", tmp_path / "o", "8")
