"""YOLO training quality: final mAP of ultralytics' trainers against the fused trainers, per task.

``python -m trainfuse.bench yolo-quality [--models a.yaml,b.yaml] [--optimizers auto,SGD]
[--seeds 0,1] [--variants stock,trainfuse,...] [--epochs N] [--parallel N]`` (needs ultralytics;
offline). Every (model, optimizer, seed, variant) is one full training run in a process of its own
(``python -m trainfuse.bench.yolo_quality --child '<json>'``, its log in
``<out>/yolo-quality-logs/<run>.log``), ``--parallel`` of them at once on one GPU, with
ultralytics' training defaults, ``cache="ram"``, ``deterministic=False`` and a config folder per
run. All runs of a task train and validate on the same synthetic dataset (one data seed: the shapes
for detection, :func:`~trainfuse.ultralytics.task_shapes.make_task_dataset`'s for segmentation,
pose, OBB and classification models); ``--seeds`` are ultralytics' training ``seed=``. The variants:

- ``stock``: ultralytics' trainer of the model's task (DetectionTrainer, SegmentationTrainer, ...);
- ``trainfuse``: the fused trainer of that task (:func:`~trainfuse.ultralytics.trainer_for`), with
  its defaults (``fused_loss=True`` included);
- ``no-graphs``, ``no-casts``, ``stock-loss``: that fused trainer with ``cuda_graphs``,
  ``fuse_casts`` or ``fused_loss`` False, to tell which change moves the mAP if one does;
- ``fuse-blocks``: that fused trainer with ``fuse_blocks=True`` (its default, None, fuses the blocks
  of detection models on one GPU);
- ``fuse-concat``: the same with ``TRAINFUSE_FUSE_CONCAT=1`` (the C2f and C3 blocks'
  concatenations written in place, the default wherever the blocks are fused);
- ``no-fuse-blocks``: that fused trainer with ``fuse_blocks=False``.

Measures mAP50 and mAP50-95 of each run's final validation (best.pt: of the masks for segmentation,
of the keypoints for pose, and for those two the boxes' mAP50-95 too; top-1 and top-5 accuracy for
classification, in those columns), per seed and their mean per variant, and the mean's difference
to stock. Goal per (model, optimizer, variant): every mean within 1 point of stock. It does not
measure time: the runs share the GPU and the CPU, so their seconds (kept in the report's runs)
compare with nothing; ``python -m trainfuse.bench yolo`` times training.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    new_report,
    note,
    parse_and_start,
    print_table,
    save_report,
)

# variant -> the fused trainer's class attributes it changes (None: ultralytics' own trainer)
VARIANTS = {"stock": None, "trainfuse": {"fused_loss": True}, "no-graphs": {"cuda_graphs": False},
            "no-casts": {"fuse_casts": False}, "stock-loss": {"fused_loss": False},
            "fuse-blocks": {"fuse_blocks": True}, "fuse-concat": {"fuse_blocks": True},
            "no-fuse-blocks": {"fuse_blocks": False}}
# variant -> the environment its child runs in
VARIANT_ENV = {"fuse-concat": {"TRAINFUSE_FUSE_CONCAT": "1"}}
DATA_SEED = 0  # every run trains and validates on the same images; --seeds only vary training
MAP_DELTA_GOAL = 0.01  # 1 point of mAP
RESULT = "RESULT "  # prefix of the child's one line of results
ERROR_LINES = 30  # lines of a failed child's log kept in the report
BOX_TOO = ("segment", "pose")  # tasks whose box mAP50-95 is compared too, beside the masks' or keypoints'


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
    return names


def _variants(text: str) -> list[str]:
    names = _names(text)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant {', '.join(unknown)}; expected a comma-separated "
                                         f"list of {', '.join(VARIANTS)}")
    return names


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = bench_parser("yolo-quality", __doc__)
    parser.add_argument("--models", type=_names, default="yolov5n.yaml,yolo11n.yaml,yolo26n.yaml",
                        help="comma list of models ultralytics builds offline, of any task "
                        "(yolo11n-seg.yaml, yolo11n-pose.yaml, yolo11n-obb.yaml, yolo11n-cls.yaml: that "
                        "task's data)")
    parser.add_argument("--optimizers", type=_names, default="auto",
                        help="comma list of ultralytics' optimizer= (auto, SGD, AdamW, MuSGD, ...)")
    parser.add_argument("--seeds", type=_seeds, default="0,1", help="comma list of ultralytics' seed=")
    parser.add_argument("--variants", type=_variants, default="stock,trainfuse",
                        help=f"comma list of trainers: {', '.join(VARIANTS)}")
    parser.add_argument("--epochs", type=_positive, default=30, help="epochs of each run (quality needs ~30)")
    parser.add_argument("--batch", type=_positive, default=None, help="16; 64 for classification")
    parser.add_argument("--imgsz", type=_positive, default=None, help="640; 224 for classification")
    parser.add_argument("--images", type=_positive, default=512, help="synthetic training images")
    parser.add_argument("--val-images", type=_positive, default=256,
                        help="synthetic validation images (mAP on a few is noisy)")
    parser.add_argument("--workers", type=int, default=2, help="data-loader workers of each run")
    parser.add_argument("--parallel", type=_positive, default=4, help="runs at once")
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "trainfuse-bench-shapes"),
                        help="where the synthetic dataset is generated (reused when it matches)")
    # the tests' tiny run on a machine without a GPU, and the spec of one child run
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def _task(model: str) -> str:
    """``model``'s task (detection where the file cannot be read: its run then fails with the error)."""
    from trainfuse.ultralytics.tasks import task_of

    try:
        return task_of(model)
    except Exception:
        return "detect"


def _trainer(variant: str, model: str):
    """The ``trainer=`` of ``variant``: the fused trainer of ``model``'s task or a subclass of it."""
    from trainfuse.ultralytics import trainer_for

    base = trainer_for(_task(model))
    changes = VARIANTS[variant]
    if not changes:
        return base
    return type(f"{base.__name__}_{variant.replace('-', '_')}", (base,), changes)


def _child(spec: dict) -> None:
    """Train the run ``spec`` describes (:func:`_specs`) and print ``RESULT {json}``."""
    from trainfuse.ultralytics.offline import offline_env

    # a config folder per run, over an inherited YOLO_CONFIG_DIR: ultralytics writes its
    # settings.json there, which concurrent runs must not share. Before ultralytics is imported.
    config = Path(spec["out"]) / f"yolo-config-{spec['run']}"
    os.environ["YOLO_CONFIG_DIR"] = str(config)
    os.environ.update(VARIANT_ENV.get(spec["variant"], {}))
    offline_env(config)
    import ultralytics
    from ultralytics import YOLO

    from trainfuse.bench.yolo_harness import final_map

    start = time.perf_counter()
    model = YOLO(spec["model"])
    extra = {} if VARIANTS[spec["variant"]] is None else {"trainer": _trainer(spec["variant"], spec["model"])}
    model.train(data=spec["data"], epochs=spec["epochs"], batch=spec["batch"], imgsz=spec["imgsz"],
                seed=spec["seed"], workers=spec["workers"], cache="ram", deterministic=False, val=False,
                plots=False, device=spec["device"], project=str(Path(spec["out"]) / "yolo-quality-runs"),
                name=spec["run"], exist_ok=True, verbose=False, optimizer=spec["optimizer"], **extra)
    trainer = model.trainer
    map50, map50_95 = final_map(trainer)
    box = (trainer.metrics or {}).get("metrics/mAP50-95(B)") if trainer.args.task in BOX_TOO else None
    # the run's name too: a parent stopped early leaves these lines as the only record
    result = {"run": spec["run"], "map50": map50, "map50_95": map50_95, "box_map50_95": box,
              "optimizer_class": type(trainer.optimizer).__name__,
              "fused_reason": getattr(trainer, "fused_reason", None),
              "graphs_reason": getattr(trainer, "graphs_reason", None),
              "losses": trainer.label_loss_items(trainer.tloss), "seconds": time.perf_counter() - start,
              "ultralytics": ultralytics.__version__}
    print(RESULT + json.dumps(result), flush=True)


def _sizes(args, task: str) -> tuple[int, int]:
    """``(batch, imgsz)`` of a ``task``'s runs: as given, else ultralytics' defaults (classification
    at 224 pixels, batch 64 as ``python -m trainfuse.bench yolo`` times it)."""
    classify = task == "classify"
    return args.batch or (64 if classify else 16), args.imgsz or (224 if classify else 640)


def _data(args, task: str) -> str:
    """The synthetic dataset of ``task`` (made once per size under ``--data-dir``)."""
    _, imgsz = _sizes(args, task)
    if task == "detect":
        from trainfuse.ultralytics.shapes import make_shapes_dataset

        folder = Path(args.data_dir) / f"{imgsz}px-{args.images}-val{args.val_images}-seed{DATA_SEED}"
        return str(make_shapes_dataset(folder, n_train=args.images, n_val=args.val_images, imgsz=imgsz,
                                       seed=DATA_SEED))
    from trainfuse.ultralytics.task_shapes import make_task_dataset

    folder = Path(args.data_dir) / f"{task}-{imgsz}px-{args.images}-val{args.val_images}-seed{DATA_SEED}"
    return str(make_task_dataset(folder, task, n_train=args.images, n_val=args.val_images, imgsz=imgsz,
                                 seed=DATA_SEED))


def _specs(args) -> list[dict]:
    """One child's spec per (model, optimizer, seed, variant); a seed's variants start together."""
    common = {"epochs": args.epochs, "workers": args.workers, "device": "cpu" if args.device == "cpu" else 0,
              "out": str(Path(args.out).resolve())}
    tasks = {model: _task(model) for model in args.models}
    data = {task: _data(args, task) for task in dict.fromkeys(tasks.values())}
    return [{"run": f"{Path(model).stem}-{opt}-seed{seed}-{variant}", "model": model, "optimizer": opt,
             "seed": seed, "variant": variant, "data": data[tasks[model]],
             **dict(zip(("batch", "imgsz"), _sizes(args, tasks[model]))), **common}
            for model in args.models for opt in args.optimizers for seed in args.seeds
            for variant in args.variants]


def _launch(spec: dict, logs: Path) -> dict:
    """Run one child to its end: ``spec`` with its results, or with ``error`` (its log's tail)."""
    log = logs / f"{spec['run']}.log"
    with open(log, "w") as f:
        command = [sys.executable, "-m", "trainfuse.bench.yolo_quality", "--child", json.dumps(spec)]
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=False)
    lines = log.read_text(errors="replace").splitlines()
    results = [json.loads(line.removeprefix(RESULT)) for line in lines if line.startswith(RESULT)]
    run = {k: spec[k] for k in ("run", "model", "optimizer", "seed", "variant")} | {"log": str(log)}
    if done.returncode == 0 and results:
        run |= results[-1]
        print(f"{run['run']}: mAP50 {_cell(run['map50'])}, mAP50-95 {_cell(run['map50_95'])}", flush=True)
        return run
    print(f"{run['run']}: failed with exit status {done.returncode} (log {log})", flush=True)
    return run | {"returncode": done.returncode, "error": "\n".join(lines[-ERROR_LINES:])}


def _mean(values: list[float | None]) -> float | None:
    """The mean of every seed's value; None when a seed has none (a failed run)."""
    return None if not values or None in values else statistics.fmean(values)


def _cell(value: float | None) -> str:
    return "failed" if value is None else f"{value:.3f}"


def _compare(report: dict, args, model: str, opt: str, runs: list[dict]) -> dict[str, bool]:
    """Print the table of one (model, optimizer), record its rows; its goals."""
    seeds = ", ".join(map(str, args.seeds))
    workload = f"{model} optimizer={opt}: final mAP after {args.epochs} epochs (mean of seeds {seeds})"
    mine = [r for r in runs if (r["model"], r["optimizer"]) == (model, opt)]
    by_variant = {v: [r for r in mine if r["variant"] == v] for v in args.variants}
    keys = ("map50", "map50_95") + (("box_map50_95",) if any(r.get("box_map50_95") is not None
                                                              for r in mine) else ())
    means = {v: {k: _mean([r.get(k) for r in rs]) for k in keys} for v, rs in by_variant.items()}
    stock = means.get("stock")
    rows, goals = [], {}
    for variant, rs in by_variant.items():
        cells = [variant, next((r["optimizer_class"] for r in rs if "optimizer_class" in r), "-")]
        within = bool(stock)
        for key in keys:
            mean = means[variant][key]
            delta = None if not stock or mean is None or stock[key] is None else mean - stock[key]
            within = within and delta is not None and abs(delta) <= MAP_DELTA_GOAL
            shown = "-" if delta is None or variant == "stock" else f"{delta * 100:+.2f}"
            cells += [_cell(r.get(key)) for r in rs] + [_cell(mean), shown]
        rows.append(cells)
        add_row(report, workload, variant, trainfuse=variant != "stock", **means[variant])
        if variant != "stock" and stock:
            goals[f"{model} optimizer={opt} {variant}: within 1 point of stock"] = within
    header = ["variant", "optimizer"]
    for metric in ("mAP50", "mAP50-95", "box mAP50-95")[:len(keys)]:
        header += [f"{metric} seed {s}" for s in args.seeds] + [f"{metric} mean", "vs stock (points)"]
    print_table(workload, header, rows)
    return goals


def _summarize(report: dict, args, runs: list[dict]) -> None:
    """The tables, the failed runs' log tails and the goals, into ``report`` too."""
    goals = {}
    for model, opt in itertools.product(args.models, args.optimizers):
        goals |= _compare(report, args, model, opt, runs)
    for run in runs:
        if "error" in run:
            print(run["error"])
            last = (run["error"].strip().splitlines() or ["no output"])[-1]
            note(report, f"{run['run']} failed (exit status {run['returncode']}, log {run['log']}): {last}")
    if goals:
        print_table("goals", ["goal", "met"], [[k, "yes" if v else "NO"] for k, v in goals.items()])
    report["goals"] = goals
    report["runs"] = runs


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return None
    if args.device == "cpu":
        report = new_report("cpu", None)
        report["_argv"] = argv
    else:
        started = parse_and_start(parser, argv, "yolo-quality")
        if started is None:
            return None
        args, report, _ = started
        import torch

        torch.cuda.empty_cache()  # the bandwidth test's 2 GiB go back to the children
    report["headline"] = None  # higher mAP is better: no speedup for benchmarks/render.py to show
    report["_bench"] = "yolo-quality"
    try:
        version = importlib.metadata.version("ultralytics")
    except importlib.metadata.PackageNotFoundError:
        note(report, "ultralytics is not installed (pip install ultralytics): nothing measured")
        save_report(report, args.out, "yolo-quality")
        return report
    logs = Path(args.out) / "yolo-quality-logs"
    logs.mkdir(parents=True, exist_ok=True)
    specs = _specs(args)
    print(f"{len(specs)} runs, {args.parallel} at once; logs in {logs}")
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        runs = list(pool.map(lambda spec: _launch(spec, logs), specs))
    note(report, f"up to {args.parallel} runs trained at once on one {report['device']}: their seconds "
                 "compare with nothing (python -m trainfuse.bench yolo times training)")
    _summarize(report, args, runs)
    report["settings"] = {k: getattr(args, k) for k in ("models", "optimizers", "seeds", "variants", "epochs",
                                                         "batch", "imgsz", "images", "val_images", "workers",
                                                         "parallel")}
    report["settings"] |= {"data_seed": DATA_SEED, "goal_map_delta": MAP_DELTA_GOAL, "ultralytics": version}
    save_report(report, args.out, "yolo-quality")
    return report


if __name__ == "__main__":
    main()
