"""YOLOv5 training with ultralytics: the stock DetectionTrainer against FusedDetectionTrainer.

``python -m trainfuse.bench yolo [--quick] [--epochs N] [--model yolov5n.yaml]`` (needs ultralytics;
offline). One process, one GPU, ultralytics' training defaults (AMP, channels_last, nbs=64 so batch
16 steps every 4th iteration, mosaic) with 8 workers, ``cache="ram"`` and ``deterministic=False``,
on the synthetic shapes dataset, same seed and data for both trainers
(``trainfuse.bench.yolo_harness`` holds the timers). Measures:

- the training-loop time per iteration (median; data wait excluded, GPU synchronized at both ends:
  at batch 16 ultralytics steps every 4th iteration, so the median is an iteration without an
  optimizer step), the data wait, the median epoch's time (steps and data wait included) and
  images per second;
- the launches (kernels, copies, fills) per iteration over one accumulation cycle (torch.profiler);
- the optimizer phase (``trainer.optimizer_step()``: unscale, clip, step, EMA, zero_grad) on its
  own, after both runs, the two trainers in alternating rounds (GC off inside each timed call, as
  timeit does): median wall time of a call and its launches; and inside the runs, the host time
  of each call (no sync: with CUDA graphs, ours replays the phase from a graph);
- quality: mAP50 / mAP50-95 of each run's final validation, and a PNG of both runs' loss curves and
  per-iteration times (``<out>/yolo.png``);
- the profiled cycle's GPU time by kind of kernel and its longest kernels by name;
- the last epoch's wall time over its iterations (steps, data wait and, synced, the syncs): with
  ``--unsynced`` both runs loop as a user's does (no per-iteration syncs, no profiled cycle, no
  per-iteration losses) and that time is the iteration the speedup compares;
- peak GPU memory of each run (``torch.cuda.max_memory_allocated``), and for ours what its CUDA
  graphs did (captures, replays, eager calls).

Goals (batch 16, imgsz 640): iteration >= 3x faster than stock for yolov5n, >= 2x for yolov5s, >= 4x
for yolo11n/yolo26n segmentation and pose, >= 3.5x for yolo11n-obb, >= 3x for yolo11n-cls (224
pixels, batch 64), >= 5x for yolo11s, >= 4x for yolo11m, >= 3x for yolo11l (``ITERATION_GOALS``),
optimizer phase >= 10x faster and at most 0.05 ms of host time in the run, peak memory within 1.3x
of stock, stock mAP50 >= 0.5 with ours within +-1 point.
``--quick`` is a smoke run (1 epoch, 256 images).

``--devices 0,1`` trains with ultralytics' DDP instead, ``--batch`` images per GPU: stock against
ours on those GPUs, and ours on one GPU for the scaling (:mod:`trainfuse.bench.yolo_ddp`); with
``--photo`` the photo runs train on those GPUs, and with ``--default-run`` every default run does
(ultralytics' default batch of 16 over all of them: :mod:`trainfuse.bench.yolo_default`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from trainfuse.bench._common import add_row, bench_parser, note, parse_and_start, print_table, save_report

GOALS = {"optimizer_phase_speedup": 10.0, "stock_map50": 0.5, "map50_delta": 0.01, "peak_memory_ratio": 1.3,
         "phase_host_ms": 0.05}
# speedup of the iteration over stock
ITERATION_GOALS = {"yolov5n.yaml": 3.0, "yolov5s.yaml": 2.0, "yolo11n-seg.yaml": 4.0, "yolo26n-seg.yaml": 4.0,
                   "yolo11n-pose.yaml": 4.0, "yolo26n-pose.yaml": 4.0, "yolo11n-obb.yaml": 3.5,
                   "yolo11n-cls.yaml": 3.0, "yolo11s.yaml": 5.0, "yolo11m.yaml": 4.0, "yolo11l.yaml": 3.0}


def _parser():
    parser = bench_parser("yolo", __doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 epoch on 256 images")
    parser.add_argument("--model", default="yolov5n.yaml",
                        help="any model ultralytics builds offline: detection (yolov5n.yaml, yolo11n.yaml, "
                        "yolo26n.yaml, ...) or another task's (yolo11n-seg.yaml, yolo11n-pose.yaml, "
                        "yolo11n-obb.yaml, yolo11n-cls.yaml: that task's synthetic data and fused trainer)")
    parser.add_argument("--fused-loss", action="store_true",
                        help="fused_loss=True, labelled as such in the workload (every task's fused trainer "
                        "trains with its fused loss by default)")
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument("--fuse-blocks", action="store_true",
                        help="fuse_blocks=True: the Conv blocks fused for any task and under DDP too (the "
                        "default, None, fuses them for detection models on one GPU)")
    blocks.add_argument("--no-fuse-blocks", action="store_true",
                        help="fuse_blocks=False: ultralytics' own Conv, C2f, SPPF and neck modules")
    parser.add_argument("--fuse-concat", action="store_true",
                        help="with --fuse-blocks, TRAINFUSE_FUSE_CONCAT=1: the C2f and C3 blocks' "
                        "concatenations written in place (the default wherever the blocks are fused)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="cudnn_benchmark=True: cuDNN times the training step's convolution algorithms "
                        "(off by default)")
    parser.add_argument("--unsynced", action="store_true",
                        help="both runs as a user's loop runs (no per-iteration GPU syncs, nothing "
                             "profiled); the iteration is the last epoch's wall time over its iterations")
    parser.add_argument("--raw-images", action="store_true",
                        help="ours with raw_images=True: the model takes the uint8 batch, its first "
                             "convolution making its input in one kernel")
    parser.add_argument("--gpu-augment", action="store_true",
                        help="gpu_augment=True: the training pixels augmented on the GPU even with the "
                        "bench's cache='ram' (segment, pose and OBB data too, which ask for it)")
    parser.add_argument("--optimizer", default="auto",
                        help="ultralytics' optimizer= (auto, SGD, AdamW, MuSGD, NAdam, ...)")
    parser.add_argument("--batch", type=int, default=None, help="images per GPU (16; 64 for classification)")
    parser.add_argument("--devices", default="0",
                        help="CUDA devices; several (0,1) train with ultralytics' DDP (bench.yolo_ddp; with "
                        "--photo or --default-run, those runs)")
    parser.add_argument("--imgsz", type=int, default=None, help="640; 224 for classification")
    parser.add_argument("--images", type=int, default=None, help="synthetic training images (512; 1,024 "
                        "with --photo)")
    parser.add_argument("--val-images", type=int, default=None, help="validation images (64; 512 with "
                        "--default-run)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of each run (30: quality needs ~30; "
                        "20 with --default-run)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--photo", action="store_true",
                        help="photo-like 640x480 JPEGs of COCO's size (1,024 unless --images; past 1,024, "
                        "copies of the first 1,024), cache off: "
                        "the loader alone, stock and ours in images/s (bench.yolo_photo)")
    parser.add_argument("--default-run", action="store_true",
                        help="a default train() end to end (validation, plots, checkpoints, cache off) on "
                        "photo-like JPEGs (2,048 unless --images), each run a fresh process, cold and warm "
                        "caches: wall clock and its parts (bench.yolo_default)")
    parser.add_argument("--stock-warm", action="store_true", help="with --default-run: stock a second time")
    parser.add_argument("--runs", default=None,
                        help="with --default-run: the runs to make, comma-separated among stock, "
                        "trainfuse-cold, trainfuse-warm, stock-warm (default: the first three, and "
                        "stock-warm with --stock-warm)")
    parser.add_argument("--previous", default=None,
                        help="with --default-run: the partial file of an earlier command's runs on this "
                        "machine (the same boot), taken as done: a long run measured in parts")
    parser.add_argument("--parallel-plots", action="store_true",
                        help="with --default-run: ours with parallel_plots=True (figures drawn by workers)")
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "trainfuse-bench-shapes"),
                        help="where the synthetic dataset is generated (reused when it matches)")
    return parser


def _phases(trainers: dict, runs: dict, rounds: int = 4,
            calls: int = 25) -> dict[str, tuple[float, int | None]]:
    """Each trainer's optimizer phase (median ms, launches), timed after both runs in alternating
    rounds: what is still winding down after a run (its data-loader workers, for one) then slows
    both alike instead of whichever was timed first. The grads reach it as in the run (``runs``'
    ``kept_grads``)."""
    from trainfuse.bench.yolo_harness import optimizer_phase

    times = {kind: [] for kind in trainers}
    launches = {}
    for _ in range(rounds):
        for kind, trainer in trainers.items():
            t, launches[kind] = optimizer_phase(trainer, calls=calls, warmup=3,
                                                kept=runs[kind]["kept_grads"])
            times[kind] += t
    return {kind: (statistics.median(times[kind]), launches[kind]) for kind in trainers}


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _summarize(report: dict, args, runs: dict[str, dict], version: str) -> None:
    """Print the tables, check the goals, draw the PNG and fill ``report`` from both runs."""
    from trainfuse.bench.yolo_harness import kernel_kind, plot_runs, runs_table

    out = Path(args.out)
    stock, ours = runs["stock"], runs["trainfuse"]
    workload = f"{args.model} batch {args.batch} imgsz {args.imgsz}"
    if args.optimizer != "auto":
        workload += f" optimizer={args.optimizer}"
    if args.fused_loss:
        workload += " fused_loss=True"
    if args.gpu_augment:
        workload += " gpu_augment=True"
    if args.raw_images:
        workload += " raw_images=True"
    if args.unsynced:
        workload += " unsynced"
    if args.fuse_blocks:
        workload += " fuse_blocks=True"
    if args.no_fuse_blocks:
        workload += " fuse_blocks=False"
    if args.fuse_concat:
        workload += " TRAINFUSE_FUSE_CONCAT=1"
    if args.cudnn_benchmark:
        workload += " cudnn_benchmark=True"
    print(f"\n{workload}, {args.epochs} epoch(s), ultralytics {version}")
    print(runs_table(runs))
    it_key = "last_epoch_iter_ms" if args.unsynced else "iter_ms"
    for kind, r in runs.items():
        impl = r["trainer"] if kind == "trainfuse" else f"ultralytics {r['trainer']}"
        add_row(report, f"{workload}: training-loop iteration", impl, trainfuse=kind != "stock",
                wall_ms=r[it_key])
        add_row(report, f"{workload}: optimizer phase (unscale, clip, step, EMA, zero_grad)", impl,
                trainfuse=kind != "stock", wall_ms=r["phase_ms"])
    it_speedup = _ratio(stock[it_key], ours[it_key])
    it_goal = ITERATION_GOALS.get(args.model)
    mem_ratio = _ratio(ours["peak_mem_gb"], stock["peak_mem_gb"])
    phase_speedup = _ratio(stock["phase_ms"], ours["phase_ms"])
    print_table("speed", ["", "stock", "trainfuse", "speedup", "goal"], [
        ["iteration ms (last epoch's wall time / iterations)" if args.unsynced else "iteration ms (median)",
         _num(stock[it_key], ".2f"), _num(ours[it_key], ".2f"), _num(it_speedup, ".2f") + "x",
         "-" if it_goal is None else f">= {it_goal}x"],
        *([] if args.unsynced else [
            ["last epoch ms / iteration (steps, data wait, syncs)", _num(stock["last_epoch_iter_ms"], ".2f"),
             _num(ours["last_epoch_iter_ms"], ".2f"),
             _num(_ratio(stock["last_epoch_iter_ms"], ours["last_epoch_iter_ms"]), ".2f") + "x", ""]]),
        ["epoch s (median; steps, data wait)", _num(stock["epoch_s"], ".3f"), _num(ours["epoch_s"], ".3f"),
         _num(_ratio(stock["epoch_s"], ours["epoch_s"]), ".2f") + "x", ""],
        ["GPU ops per iteration", _num(stock["launches_per_iteration"], ".0f"),
         _num(ours["launches_per_iteration"], ".0f"), "", ""],
        ["host launches per iteration", _num(stock["host_launches_per_iteration"], ".0f"),
         _num(ours["host_launches_per_iteration"], ".0f"), "", ""],
        ["peak GPU memory GB", _num(stock["peak_mem_gb"], ".2f"), _num(ours["peak_mem_gb"], ".2f"),
         _num(mem_ratio, ".2f") + "x", f"<= {GOALS['peak_memory_ratio']}x"],
        ["optimizer phase ms", _num(stock["phase_ms"], ".3f"), _num(ours["phase_ms"], ".3f"),
         _num(phase_speedup, ".1f") + "x", f">= {GOALS['optimizer_phase_speedup']}x"],
        ["optimizer phase launches", _num(stock["phase_launches"], "d"), _num(ours["phase_launches"], "d"),
         "", "<= 3"],
        ["optimizer phase host ms (in the run)", _num(stock["phase_host_ms"], ".3f"),
         _num(ours["phase_host_ms"], ".3f"), "", f"<= {GOALS['phase_host_ms']}"],
    ])
    kinds = sorted(set(stock.get("gpu_ms_by_kind", {})) | set(ours.get("gpu_ms_by_kind", {})))
    if kinds:  # the profiled cycle's GPU time per iteration, by kind of kernel
        print_table("GPU ms per iteration by kind of kernel (one profiled accumulation cycle)",
                    ["kind", "stock", "trainfuse"],
                    [[k, _num(stock.get("gpu_ms_by_kind", {}).get(k, 0.0), ".3f"),
                      _num(ours.get("gpu_ms_by_kind", {}).get(k, 0.0), ".3f")] for k in kinds])
    for kind in ("stock", "trainfuse"):  # the kernels behind those kinds, longest first
        top = runs[kind].get("top_kernels") or []
        if top:
            print_table(f"{kind}: the kernels of the most GPU time per iteration",
                        ["kernel", "kind", "ms", "calls"],
                        [[name, kernel_kind(name), _num(ms, ".3f"), _num(calls, ".1f")]
                         for name, ms, calls in top[:15]])
    delta = None if stock["map50"] is None or ours["map50"] is None else ours["map50"] - stock["map50"]
    goals = {"iteration": it_goal is not None and it_speedup is not None and it_speedup >= it_goal,
             "peak_memory": mem_ratio is not None and mem_ratio <= GOALS["peak_memory_ratio"],
             "optimizer_phase": (phase_speedup is not None
                                 and phase_speedup >= GOALS["optimizer_phase_speedup"]),
             "optimizer_phase_launches": ours["phase_launches"] is not None and ours["phase_launches"] <= 3,
             "optimizer_phase_host": (ours["phase_host_ms"] is not None
                                      and ours["phase_host_ms"] <= GOALS["phase_host_ms"]),
             "stock_map50": stock["map50"] is not None and stock["map50"] >= GOALS["stock_map50"],
             "map50_within_1_point": delta is not None and abs(delta) <= GOALS["map50_delta"]}
    print_table("goals", ["goal", "met"], [[k, "yes" if v else "NO"] for k, v in goals.items()])
    if args.quick:
        note(report, "--quick: 1 epoch; the quality goals need the full run")
    name = _family(args)
    png = plot_runs(runs, out / f"{name}.png",
                    title=f"{workload}, {args.epochs} epoch(s), {report['device']}")
    print(f"plot: {png}")
    if (args.model, args.optimizer) != ("yolov5n.yaml", "auto"):  # the README's summary: one phase row
        report["summary_skip"] = [f"{workload}: optimizer phase (unscale, clip, step, EMA, zero_grad)"]
    report["goals"] = goals
    report["goal_values"] = {**GOALS, "iteration_speedup": it_goal}
    report["runs"] = {k: {key: v for key, v in r.items() if key not in ("losses", "iter_ms_all")}
                      for k, r in runs.items()}
    report["curves"] = {k: {"losses": r["losses"], "iter_ms": r["iter_ms_all"]} for k, r in runs.items()}
    report["settings"] = {"model": args.model, "optimizer": args.optimizer, "batch": args.batch,
                          "imgsz": args.imgsz,
                          "epochs": args.epochs, "images": args.images, "val_images": args.val_images,
                          "workers": args.workers, "seed": args.seed, "ultralytics": version}


def main(argv: list[str] | None = None) -> dict | None:
    started = parse_and_start(_parser(), argv, "yolo")
    if started is None:
        return None
    args, report, _ = started
    if args.default_run:
        args.photo = True
    if args.images is None:
        args.images = 2048 if args.default_run else 1024 if args.photo else 512
    if args.val_images is None:
        args.val_images = 512 if args.default_run else 64
    if args.epochs is None:
        args.epochs = 20 if args.default_run else 30
    if args.quick:
        args.epochs, args.images, args.val_images = 1, 256, 32
    from trainfuse.ultralytics.tasks import task_of

    task = task_of(args.model)
    args.batch = args.batch or (64 if task == "classify" else 16)
    args.imgsz = args.imgsz or (224 if task == "classify" else 640)
    if task != "detect" and (args.photo or args.default_run or len(args.devices.split(",")) > 1):
        raise SystemExit(f"yolo: --photo, --default-run and several --devices measure detection models; "
                         f"{args.model} is a {task!r} model")
    out = Path(args.out)
    from trainfuse.ultralytics.offline import offline_env

    offline_env(out / "yolo-config")  # before ultralytics is imported
    try:
        import ultralytics
    except ImportError:
        note(report, "ultralytics is not installed (pip install ultralytics): nothing measured")
        report["_bench"] = "yolo"
        save_report(report, args.out, family(args.model, args.optimizer))
        return report
    data = _dataset(args, task)
    if args.default_run:
        from trainfuse.bench import yolo_default

        yolo_default.run(report, args, data, out, ultralytics.__version__)
        report["_bench"] = "yolo"
        # parallel_plots (off by default) changes the runs measured: a family of its own
        save_report(report, args.out, yolo_default.family_of(args))
        return report
    if args.photo:
        from trainfuse.bench import yolo_photo

        yolo_photo.run(report, args, data, out, ultralytics.__version__)
        report["_bench"] = "yolo"
        save_report(report, args.out, "yolo-photo")
        return report
    if len(args.devices.split(",")) > 1:
        from trainfuse.bench import yolo_ddp

        yolo_ddp.run(report, args, data, out, ultralytics.__version__)
        report["_bench"] = "yolo"
        save_report(report, args.out, family(args.model, args.optimizer, args.devices))
        return report
    from trainfuse.bench.yolo_harness import train_run

    runs, trainers = {}, {}
    options = {"fused_loss": True} if args.fused_loss else {}
    if args.gpu_augment:
        options["gpu_augment"] = True
    if args.raw_images:
        options["raw_images"] = True
    if args.fuse_blocks or args.no_fuse_blocks:
        options["fuse_blocks"] = bool(args.fuse_blocks)
    if args.cudnn_benchmark:
        options["cudnn_benchmark"] = True
    if args.fuse_concat:
        if not args.fuse_blocks:
            raise SystemExit("--fuse-concat writes the concatenations from the fused blocks: add "
                             "--fuse-blocks")
        os.environ["TRAINFUSE_FUSE_CONCAT"] = "1"  # read when the trainer starts (stock ignores it)
    for kind in ("stock", "trainfuse"):
        runs[kind], trainers[kind] = train_run(kind, args, data, out / "yolo-runs", device=args.devices,
                                               unsynced=args.unsynced,
                                               **(options if kind == "trainfuse" else {}))
    for kind, (ms, launches) in _phases(trainers, runs).items():
        runs[kind]["phase_ms"], runs[kind]["phase_launches"] = ms, launches
    _summarize(report, args, runs, ultralytics.__version__)
    report["_bench"] = "yolo"
    save_report(report, args.out, _family(args))
    return report


def _dataset(args, task: str) -> str:
    """The synthetic data of ``task`` (made once per size and seed under ``--data-dir``): the
    shapes for detection (photo-like with ``--photo``), :func:`~trainfuse.ultralytics.task_shapes.
    make_task_dataset`'s for the other tasks."""
    if task != "detect":
        from trainfuse.ultralytics.task_shapes import make_task_dataset

        name = f"{task}-{args.imgsz}px-{args.images}-val{args.val_images}-seed{args.seed}"
        return str(make_task_dataset(Path(args.data_dir) / name, task, n_train=args.images,
                                     n_val=args.val_images, imgsz=args.imgsz, seed=args.seed))
    from trainfuse.ultralytics.shapes import make_shapes_dataset

    kind = "photo-" if args.photo else ""
    folder = Path(args.data_dir) / f"{kind}{args.imgsz}px-{args.images}-seed{args.seed}"
    return str(make_shapes_dataset(folder, n_train=args.images, n_val=args.val_images, imgsz=args.imgsz,
                                   seed=args.seed, photo=args.photo,
                                   distinct=1024 if args.photo and args.images > 1024 else None))


def _family(args: argparse.Namespace) -> str:
    """:func:`family` of a training run's command line."""
    return family(args.model, args.optimizer, fused_loss=args.fused_loss, gpu_augment=args.gpu_augment,
                  raw_images=args.raw_images, unsynced=args.unsynced,
                  fuse_blocks=True if args.fuse_blocks else (False if args.no_fuse_blocks else None),
                  fuse_concat=args.fuse_concat, cudnn_benchmark=args.cudnn_benchmark, batch=args.batch)


def family(model: str, optimizer: str = "auto", devices: str = "0", fused_loss: bool = False,
           gpu_augment: bool = False, raw_images: bool = False, unsynced: bool = False,
           fuse_blocks: bool | None = None, fuse_concat: bool = False, cudnn_benchmark: bool = False,
           batch: int | None = None) -> str:
    """The results' name: ``yolo`` for the default yolov5n, ``yolo-<model stem>`` for another,
    ``-batch<N>`` for a batch other than the task's default, ``-<optimizer>`` appended for an
    optimizer other than ``auto``, ``-fused-loss`` with ``--fused-loss``, ``-gpu-augment`` with
    ``--gpu-augment``, ``-raw-images`` with ``--raw-images``, ``-fuse-blocks`` with ``--fuse-blocks``
    (``-fuse-concat`` after it with ``--fuse-concat``), ``-no-fuse-blocks`` with
    ``--no-fuse-blocks``, ``-cudnn-benchmark`` with ``--cudnn-benchmark``, ``-unsynced`` with
    ``--unsynced``, ``-<N>gpus`` for DDP."""
    name = "yolo" if model == "yolov5n.yaml" else f"yolo-{Path(model).stem}"
    default_batch = 64 if Path(model).stem.endswith("-cls") else 16
    name = name if batch in (None, default_batch) else f"{name}-batch{batch}"
    name = name if optimizer == "auto" else f"{name}-{optimizer}"
    name = f"{name}-fused-loss" if fused_loss else name
    name = f"{name}-gpu-augment" if gpu_augment else name
    name = f"{name}-raw-images" if raw_images else name
    name = f"{name}-fuse-blocks" if fuse_blocks else name
    name = f"{name}-no-fuse-blocks" if fuse_blocks is False else name
    name = f"{name}-fuse-concat" if fuse_concat else name
    name = f"{name}-cudnn-benchmark" if cudnn_benchmark else name
    name = f"{name}-unsynced" if unsynced else name
    n = len(devices.split(","))
    return name if n == 1 else f"{name}-{n}gpus"
