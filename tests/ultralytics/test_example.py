"""examples/yolov5/train.py and its synthetic dataset generator (trainfuse.ultralytics.shapes)."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainfuse.ultralytics.offline import offline_env
from trainfuse.ultralytics.shapes import CLASSES, make_shapes_dataset

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "yolov5" / "train.py"


def _example():
    """examples/yolov5/train.py as a module (loading it imports no ultralytics)."""
    spec = importlib.util.spec_from_file_location("yolov5_example_train", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in {".jpg", ".txt"}}


def test_help_lists_the_modes_without_importing_ultralytics():
    probe = ("import runpy, sys; sys.argv = ['train.py', '--help']\n"
             f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
             "except SystemExit as e:\n    assert e.code == 0, e.code\n"
             "assert 'ultralytics' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--baseline", "--compare", "--model", "--data", "--images", "--gpu-augment", "key=value"):
        assert flag in out.stdout


def test_generator_is_deterministic_from_its_seed(tmp_path):
    a = make_shapes_dataset(tmp_path / "a", n_train=4, n_val=2, imgsz=64, seed=3)
    b = make_shapes_dataset(tmp_path / "b", n_train=4, n_val=2, imgsz=64, seed=3)
    c = make_shapes_dataset(tmp_path / "c", n_train=4, n_val=2, imgsz=64, seed=4)
    da, db, dc = _digest(a.parent), _digest(b.parent), _digest(c.parent)
    assert len(da) == 2 * (4 + 2)
    assert da == db
    assert da.keys() == dc.keys() and da != dc


@pytest.mark.parametrize("nc,imgsz", [(5, 64), (2, 96)])
def test_generator_writes_yolo_labels_for_its_images(tmp_path, nc, imgsz):
    import cv2

    yaml = make_shapes_dataset(tmp_path, n_train=6, n_val=3, imgsz=imgsz, seed=0, nc=nc, max_objects=4)
    text = yaml.read_text()
    assert "train: images/train" in text and "val: images/val" in text
    assert all(f"  {k}: {CLASSES[k]}" in text for k in range(nc)) and CLASSES[nc - 1] in text
    if nc < len(CLASSES):
        assert CLASSES[nc] not in text
    for split, n in (("train", 6), ("val", 3)):
        images = sorted((tmp_path / "images" / split).iterdir())
        assert len(images) == n
        for image in images:
            assert cv2.imread(str(image)).shape == (imgsz, imgsz, 3)
            rows = (tmp_path / "labels" / split / f"{image.stem}.txt").read_text().split("\n")[:-1]
            assert 1 <= len(rows) <= 4
            for row in rows:
                cls, *box = row.split()
                assert 0 <= int(cls) < nc
                x, y, w, h = map(float, box)
                assert 0.0 <= x - w / 2 and x + w / 2 <= 1.0 and 0.0 <= y - h / 2 and y + h / 2 <= 1.0
                assert 0.05 < w < 0.31 and 0.05 < h < 0.31


def test_generator_reuses_a_matching_dataset_and_replaces_another(tmp_path):
    yaml = make_shapes_dataset(tmp_path, n_train=4, n_val=2, imgsz=64, seed=0)
    stamp = yaml.stat().st_mtime_ns
    assert make_shapes_dataset(tmp_path, n_train=4, n_val=2, imgsz=64, seed=0).stat().st_mtime_ns == stamp
    make_shapes_dataset(tmp_path, n_train=2, n_val=2, imgsz=64, seed=0)
    assert len(list((tmp_path / "images" / "train").iterdir())) == 2
    assert len(list((tmp_path / "labels" / "train").iterdir())) == 2


def test_photo_images_follow_their_own_seed_whatever_the_dataset_size(tmp_path):
    # 70 training images are drawn by worker processes, 3 in this one: image i is the same
    big = make_shapes_dataset(tmp_path / "big", n_train=70, n_val=1, imgsz=64, photo=True).parent
    small = make_shapes_dataset(tmp_path / "small", n_train=3, n_val=1, imgsz=64, photo=True).parent
    for name in ("images/train/00002.jpg", "labels/train/00002.txt", "images/val/00000.jpg"):
        assert (big / name).read_bytes() == (small / name).read_bytes(), name
    assert (big / "images/train/00000.jpg").read_bytes() != (big / "images/val/00000.jpg").read_bytes()
    assert len(list((big / "labels" / "train").iterdir())) == 70


@pytest.mark.parametrize("bad,match", [({"nc": 0}, "nc=0"), ({"nc": 6}, "nc=6"), ({"n_val": 0}, "n_val=0"),
                                       ({"imgsz": 16}, "imgsz=16")])
def test_generator_rejects_bad_arguments(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        make_shapes_dataset(tmp_path, **{"n_train": 2, "n_val": 1, "imgsz": 64, **bad})
    assert not any(tmp_path.iterdir())


@pytest.mark.cpu_training
def test_compare_trains_both_and_writes_the_table_and_plot(tmp_path, capsys):
    pytest.importorskip("ultralytics")
    runs = _example().main(["--compare", "--images", "8", "--val-images", "4", "--imgsz", "64", "--epochs",
                            "1", "--batch", "4", "--workers", "0", "--device", "cpu", "--out", str(tmp_path),
                            "plots=False", "optimizer=SGD"])
    assert list(runs) == ["stock", "trainfuse"]
    for r in runs.values():
        assert r["iterations"] == 2 and len(r["losses"]) == 2 and r["iter_ms"] > 0
        assert 0.0 <= r["map50"] <= 1.0 and 0.0 <= r["map50_95"] <= 1.0
    assert runs["trainfuse"]["losses"][0] == pytest.approx(runs["stock"]["losses"][0], rel=1e-4)
    table = capsys.readouterr().out
    assert "iter ms (median)" in table and "mAP50-95" in table
    # on the CPU both trainers run torch's kernels: no speedup claimed, and the reason given
    assert "compare torch with itself" in table and "faster with trainfuse" not in table
    assert (tmp_path / "yolov5.png").stat().st_size > 10_000
    assert (tmp_path / "summary.json").exists()
    assert (tmp_path / "trainfuse" / "weights" / "last.pt").exists()


@pytest.mark.cpu_training
def test_gpu_augment_reaches_the_trainer(tmp_path):
    pytest.importorskip("ultralytics")
    runs = _example().main(["--images", "8", "--val-images", "4", "--imgsz", "64", "--epochs", "1", "--batch",
                            "4", "--workers", "0", "--device", "cpu", "--out", str(tmp_path), "--gpu-augment",
                            "on", "plots=False"])
    assert runs["trainfuse"]["iterations"] == 2
    assert runs["trainfuse"]["augmentation"] == "GPU"


def test_the_default_output_folder_is_ignored_by_git():
    root = SCRIPT.parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    out = Path(_example().OUT)
    assert out.parent == SCRIPT.parent
    try:
        check = subprocess.run(["git", "check-ignore", "-q", str(out / "summary.json")], cwd=root, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    assert check.returncode == 0, f"{out} is not ignored by .gitignore"
