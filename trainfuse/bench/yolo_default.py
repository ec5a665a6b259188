"""``python -m trainfuse.bench yolo --default-run``: what a user's clock shows for
``YOLO("yolov5n.yaml").train(data=..., epochs=...)`` with every other argument at its default
(validation every epoch, plots, checkpoints, ``cache=False``, 8 workers), stock against
``FusedDetectionTrainer``, on photo-like JPEGs.

Each run is a fresh process (:func:`one_run`, ``python -m trainfuse.bench.yolo_default``), its wall
clock split into parts by :class:`~trainfuse.bench.timeline.Timeline` (setup, first step, training,
validation, epoch ends, final evaluation). Runs, in this order:

- ``stock``: ultralytics' trainer, the dataset's label caches removed first (as on a new machine);
- ``trainfuse-cold``: ours with empty Triton, inductor and trainfuse caches and no label caches,
  as on a new machine (the kernels trainfuse ships a manifest of compile ahead, the rest in the run);
- ``trainfuse-warm``: ours again, the caches as the cold run left them;
- with ``--stock-warm``, ``stock-warm``: stock again (its label caches there).

``--parallel-plots`` runs ours with ``parallel_plots=True`` (the figures drawn by worker processes),
saved as the family ``yolo-default-run-parallel-plots``.

Machine-wide caches neither trainer owns (matplotlib's font list) are built before the first run.

Goals: the wall clock at least 3x stock's cold and 3.5x warm, the time to the first step at most
stock's plus 5 s cold and plus 1 s warm.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainfuse.bench._common import add_row, note, print_table

GOALS = {"cold_speedup": 3.0, "warm_speedup": 3.5, "first_step_cold_extra_s": 5.0,
         "first_step_warm_extra_s": 1.0}
PARTS = ("setup", "first_step", "train", "validation", "epoch_ends", "final")
PARTIAL = "yolo-default-run.partial.json"  # under --out: the runs finished so far, rewritten after each


def one_run(kind: str, data: str, epochs: int, project: str, name: str, seed: int = 0,
            parallel_plots: bool = False) -> dict:
    """One default ``train()`` of ``kind`` (``stock`` or ``trainfuse``) in this process: its
    :meth:`~trainfuse.bench.timeline.Timeline.parts`, final mAPs and what it compiled ahead."""
    from ultralytics import YOLO

    from trainfuse.bench.timeline import Timeline

    model = YOLO("yolov5n.yaml")
    timeline = Timeline().attach(model)
    kwargs = {"data": data, "epochs": epochs, "project": project, "name": name, "exist_ok": True,
              "seed": seed}
    if kind == "trainfuse":
        from trainfuse.ultralytics import FusedDetectionTrainer

        kwargs["trainer"] = (functools.partial(FusedDetectionTrainer, parallel_plots=True) if parallel_plots
                             else FusedDetectionTrainer)
    timeline.start()
    model.train(**kwargs)
    timeline.stop()
    metrics = model.trainer.metrics or {}
    return {**timeline.parts(), "map50": metrics.get("metrics/mAP50(B)"),
            "map50_95": metrics.get("metrics/mAP50-95(B)")}


def _spawn(kind: str, data: str, epochs: int, project: Path, name: str, env: dict, seed: int,
           parallel_plots: bool) -> dict:
    result = project / f"{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "trainfuse.bench.yolo_default", kind, data, str(epochs), str(project),
               name, str(seed), str(int(parallel_plots))]
    subprocess.run(command, env=env, check=True)
    return json.loads(result.read_text())


def _forget_labels(data: str) -> None:
    for cache in Path(data).parent.glob("labels/*.cache"):
        cache.unlink()


def run(report: dict, args, data: str, out: Path, version: str) -> None:
    """The runs of the module docstring, into ``report``."""
    caches = Path(tempfile.mkdtemp(prefix="trainfuse-default-run-"))  # the caches and run folders, removed
    project = caches / "runs"
    project.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"), "TORCHINDUCTOR_CACHE_DIR":
           str(caches / "inductor"), "TRAINFUSE_CACHE_DIR": str(caches / "trainfuse")}
    plan = [("stock", "stock", True), ("trainfuse", "trainfuse-cold", True),
            ("trainfuse", "trainfuse-warm", False)]
    if args.stock_warm:
        plan.append(("stock", "stock-warm", False))
    runs = {}
    # machine-wide caches neither trainer owns (matplotlib's font list, built on its first import)
    # are made before the first run, so the stock run does not pay for both
    subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], env=env, check=False)
    try:
        for kind, name, cold in plan:
            if cold:
                _forget_labels(data)
            runs[name] = _spawn(kind, data, args.epochs, project, name, env, args.seed, args.parallel_plots)
            print(f"{name}: {runs[name]['wall']:.1f} s", flush=True)
            # each finished run's parts at once: a bench cut off later (a time limit) keeps them
            out.mkdir(parents=True, exist_ok=True)
            (out / PARTIAL).write_text(json.dumps(runs, indent=1))
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    stock_warm = runs.get("stock-warm", runs["stock"])
    first = {name: r["setup"] + r["first_step"] for name, r in runs.items()}
    first_stock_warm = first.get("stock-warm", first["stock"])
    workload = (f"yolov5n default train(): {args.epochs} epochs, {args.images} photo-like JPEGs, "
                f"{args.val_images} to validate each epoch")
    if args.parallel_plots:
        workload += ", ours with parallel_plots=True"
    rows = [[name, f"{r['wall']:.1f}", f"{first[name]:.1f}", *(f"{r[p]:.2f}" for p in PARTS),
             "-" if r["map50_95"] is None else f"{r['map50_95']:.3f}"] for name, r in runs.items()]
    print_table(workload, ["run", "wall s", "to first step s", *(f"{p} s" for p in PARTS), "mAP50-95"], rows)
    cold = runs["stock"]["wall"] / runs["trainfuse-cold"]["wall"]
    warm = stock_warm["wall"] / runs["trainfuse-warm"]["wall"]
    extra_cold = first["trainfuse-cold"] - first["stock"]
    extra_warm = first["trainfuse-warm"] - first_stock_warm
    goals = {"cold_speedup": cold >= GOALS["cold_speedup"], "warm_speedup": warm >= GOALS["warm_speedup"],
             "first_step_cold": extra_cold <= GOALS["first_step_cold_extra_s"],
             "first_step_warm": extra_warm <= GOALS["first_step_warm_extra_s"]}
    print_table("the user's clock", ["", "value", "goal", "met"], [
        ["wall clock, cold: stock / ours", f"{cold:.2f}x", f">= {GOALS['cold_speedup']}x",
         goals["cold_speedup"]],
        ["wall clock, warm: stock / ours", f"{warm:.2f}x", f">= {GOALS['warm_speedup']}x",
         goals["warm_speedup"]],
        ["to first step, cold: ours - stock", f"{extra_cold:+.1f} s",
         f"<= +{GOALS['first_step_cold_extra_s']} s", goals["first_step_cold"]],
        ["to first step, warm: ours - stock", f"{extra_warm:+.1f} s",
         f"<= +{GOALS['first_step_warm_extra_s']} s", goals["first_step_warm"]]])
    rows = list(runs.items())
    if not args.stock_warm:  # the warm rows' stock: the one stock run (see the note)
        rows.insert(2, ("stock-warm", runs["stock"]))
    for name, r in rows:
        caches = "warm" if name.endswith("warm") else "cold"
        impl = "ultralytics DetectionTrainer" if name.startswith("stock") else "FusedDetectionTrainer"
        add_row(report, f"{workload}: wall clock of train(), {caches} caches", impl,
                trainfuse=name.startswith("trainfuse"), wall_ms=r["wall"] * 1e3)
    if not args.stock_warm:
        note(report, "the warm ratio divides the stock run's wall clock (label caches removed first): stock "
                     "has no compile caches, and its label cache saves it well under a second")
    report["goals"], report["goal_values"] = goals, GOALS
    report["runs"] = runs
    report["settings"] = {"model": "yolov5n.yaml", "epochs": args.epochs, "images": args.images,
                          "val_images": args.val_images, "seed": args.seed, "ultralytics": version,
                          "defaults": "val=True, plots=True, cache=False, workers=8, batch=16, imgsz=640",
                          "parallel_plots": args.parallel_plots}


if __name__ == "__main__":
    kind, data, epochs, project, name, seed, plots = sys.argv[1:8]
    result = one_run(kind, data, int(epochs), project, name, int(seed), plots == "1")
    Path(project, f"{name}.json").write_text(json.dumps(result))
