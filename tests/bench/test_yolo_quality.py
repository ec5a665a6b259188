"""``python -m trainfuse.bench yolo-quality`` on the CPU: a tiny real matrix, each run a child
process with its own log and config folder, and the report's rows, runs, notes and goals."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ultralytics")

from trainfuse.bench._common import new_report  # noqa: E402
from trainfuse.bench.yolo_quality import _compare, _parser, main  # noqa: E402

VARIANTS = ("stock", "trainfuse")


def _tiny(tmp_path, model: str) -> list[str]:
    """A matrix of one run per variant, 2 iterations of 4 images at 64 px, both runs at once."""
    return ["--device", "cpu", "--models", model, "--seeds", "0", "--variants", ",".join(VARIANTS),
            "--epochs", "1", "--images", "8", "--val-images", "4", "--imgsz", "64", "--batch", "4",
            "--workers", "0", "--parallel", "2", "--data-dir", str(tmp_path / "shapes"),
            "--out", str(tmp_path / "out")]


@pytest.mark.cpu_training
def test_a_tiny_cpu_matrix_reports_each_variants_map_and_keeps_each_runs_log(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "shared-config"))  # each run overrides it
    out = tmp_path / "out"
    report = main(_tiny(tmp_path, "yolov5n.yaml"))
    saved = json.loads((out / "yolo-quality.json").read_text())
    assert saved["family"] == "yolo-quality"
    assert saved["command"].startswith("python -m trainfuse.bench yolo-quality --device cpu")
    assert [row["impl"] for row in saved["rows"]] == list(VARIANTS)
    assert [row["trainfuse"] for row in saved["rows"]] == [False, True]
    for row in saved["rows"]:
        assert row["workload"] == "yolov5n.yaml optimizer=auto: final mAP after 1 epochs (mean of seeds 0)"
        assert isinstance(row["map50"], float) and isinstance(row["map50_95"], float)
    runs = saved["details"]["runs"]
    assert [run["variant"] for run in runs] == list(VARIANTS)
    for run in runs:
        assert "error" not in run, run["error"]
        assert (out / "yolo-quality-logs" / f"{run['run']}.log").read_text()
        assert (out / f"yolo-config-{run['run']}" / "Ultralytics" / "Arial.ttf").is_file()
    assert not (tmp_path / "shared-config").exists()
    assert [run["optimizer_class"] for run in runs] == ["AdamW", "FusedAdamW"]
    assert [run["fused_reason"] for run in runs] == [None, ""]
    goal = "yolov5n.yaml optimizer=auto trainfuse: within 1 point of stock"
    assert list(saved["details"]["goals"]) == [goal]
    assert report["rows"] == saved["rows"]


def test_a_failed_run_is_a_row_without_map_and_a_note_with_its_error(tmp_path):
    out = tmp_path / "out"
    main(_tiny(tmp_path, "nosuch.yaml"))
    saved = json.loads((out / "yolo-quality.json").read_text())
    assert [(row["impl"], row["map50"], row["map50_95"]) for row in saved["rows"]] == [
        ("stock", None, None), ("trainfuse", None, None)]
    for run in saved["details"]["runs"]:
        assert run["returncode"] == 1
        assert "FileNotFoundError: 'nosuch.yaml' does not exist" in run["error"]
    failed = [n for n in saved["notes"] if "failed" in n]
    assert len(failed) == 2 and all(n.endswith("'nosuch.yaml' does not exist") for n in failed)
    goal = "nosuch.yaml optimizer=auto trainfuse: within 1 point of stock"
    assert saved["details"]["goals"] == {goal: False}


def test_an_unknown_variant_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--variants", "stock,fast"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --variants: unknown variant fast" in err
    assert "stock, trainfuse, no-graphs, no-casts, stock-loss, fuse-blocks, fuse-concat" in err


@pytest.mark.cpu_training
def test_a_classification_model_trains_on_class_folders_with_its_tasks_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "shared-config"))
    args = _tiny(tmp_path, "yolov8n-cls.yaml")
    args[args.index("--imgsz") + 1] = "32"
    main(args)
    runs = json.loads((tmp_path / "out" / "yolo-quality.json").read_text())["details"]["runs"]
    for run in runs:
        assert "error" not in run, run["error"]
        assert 0.0 <= run["map50"] <= run["map50_95"] <= 1.0  # top-1, top-5 accuracy
        assert run["box_map50_95"] is None
    assert (tmp_path / "shapes" / "classify-32px-8-val4-seed0" / "train").is_dir()
    log = (tmp_path / "out" / "yolo-quality-logs" / f"{runs[1]['run']}.log").read_text()
    assert "loss skipped: ClassificationModel keeps ultralytics' cross-entropy" in log
    assert runs[1]["graphs_reason"] == "the device is cpu, not CUDA"
    assert [run["optimizer_class"] for run in runs] == ["AdamW", "FusedAdamW"]


def test_segmentation_compares_the_boxes_too_and_a_box_gap_misses_the_goal(capsys):
    args = _parser().parse_args(["--device", "cpu", "--models", "yolo11n-seg.yaml", "--seeds", "0,1"])
    runs = [{"model": "yolo11n-seg.yaml", "optimizer": "auto", "seed": seed, "variant": variant,
             "optimizer_class": "AdamW", "map50": 0.9, "map50_95": 0.7 + seed / 100,
             "box_map50_95": 0.8 - (0.015 if variant == "trainfuse" else 0.0)}
            for seed in (0, 1) for variant in ("stock", "trainfuse")]
    report = new_report("cpu", None)
    goals = _compare(report, args, "yolo11n-seg.yaml", "auto", runs)
    assert goals == {"yolo11n-seg.yaml optimizer=auto trainfuse: within 1 point of stock": False}
    stock, fused = report["rows"]
    assert stock["box_map50_95"] == pytest.approx(0.8) and fused["box_map50_95"] == pytest.approx(0.785)
    assert fused["map50_95"] == pytest.approx(0.705)
    out = capsys.readouterr().out
    assert "box mAP50-95 mean" in out and "-1.50" in out
