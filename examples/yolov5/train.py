"""Train YOLOv5 with trainfuse's FusedDetectionTrainer, offline, on a synthetic shapes dataset.

    python examples/yolov5/train.py                          # YOLOv5n, trainfuse, synthetic data
    python examples/yolov5/train.py --model yolov5s.yaml     # YOLOv5s
    python examples/yolov5/train.py --baseline               # stock ultralytics instead
    python examples/yolov5/train.py --compare                # both, same data and seed: table + PNG
    python examples/yolov5/train.py --data my.yaml lr0=0.02  # your dataset; any ultralytics argument

Prints a table (training-loop time per iteration, data wait, epoch time, images per second,
mAP50 and mAP50-95 from ultralytics' validator) and writes ``<out>/yolov5.png`` (loss curves and
per-iteration time of each run) and ``<out>/summary.json``; ``<out>`` defaults to ``runs/`` next
to this script, which git ignores. On the CPU FusedDetectionTrainer falls back to torch's own
kernels, so the timings compare torch with itself and no speedup is printed.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
from pathlib import Path

RUNS = {"trainfuse": "FusedDetectionTrainer", "stock": "ultralytics DetectionTrainer"}
OUT = Path(__file__).resolve().parent / "runs"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:8]))
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--baseline", action="store_true", help="train with stock ultralytics only")
    which.add_argument("--compare", action="store_true", help="train stock ultralytics, then trainfuse")
    parser.add_argument("--model", default="yolov5n.yaml", help="model yaml or .pt (default yolov5n.yaml)")
    parser.add_argument("--data", default=None, help="dataset yaml (default: generate the synthetic one)")
    parser.add_argument("--images", type=int, default=512, help="synthetic training images (default 512)")
    parser.add_argument("--val-images", type=int, default=64, help="synthetic validation images (default 64)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--seed", type=int, default=0, help="dataset and training seed")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", default=None, help="ultralytics device ('0', 'cpu'; default: auto)")
    parser.add_argument("--gpu-augment", choices=("auto", "on", "off"), default="auto",
                        help="trainfuse runs: JPEG decoding and the augmentation's warp, HSV and flips "
                        "on the GPU (FusedDetectionTrainer(gpu_augment=...)); auto (the default): on CUDA "
                        "where the images are read from disk every epoch (not cache=ram)")
    parser.add_argument("--out", default=str(OUT),
                        help="runs, dataset, table and PNG go here (default: runs/ next to this script)")
    parser.add_argument("--online", action="store_true",
                        help="let ultralytics use the network (default: YOLO_OFFLINE=1, local font)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="more ultralytics train arguments, e.g. optimizer=SGD lr0=0.01 cache=ram")
    args = parser.parse_args(argv)
    extra = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"argument {item!r}: expected key=value")
        try:
            extra[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            extra[key] = value
    args.extra = extra
    return args


def train(kind: str, args: argparse.Namespace, data: str, out: Path) -> dict:
    """One run (``kind`` "trainfuse" or "stock"); returns its summary."""
    from ultralytics import YOLO

    from trainfuse.bench.yolo_harness import LoopTimer, final_map
    from trainfuse.ultralytics import FusedDetectionTrainer

    model = YOLO(args.model)
    timer = LoopTimer().attach(model)
    train_args = {"data": data, "epochs": args.epochs, "batch": args.batch, "imgsz": args.imgsz,
                  "seed": args.seed, "workers": args.workers, "project": str(out.resolve()), "name": kind,
                  "exist_ok": True, **({"device": args.device} if args.device is not None else {}),
                  **args.extra}
    if kind == "trainfuse":
        setting = {"auto": None, "on": True, "off": False}[args.gpu_augment]
        train_args["trainer"] = functools.partial(FusedDetectionTrainer, gpu_augment=setting)
    model.train(**train_args)
    summary = timer.summary(args.batch)
    summary["map50"], summary["map50_95"] = final_map(model.trainer)
    summary["losses"], summary["iter_ms_all"] = timer.losses, timer.iter_ms()
    summary["device"] = str(model.trainer.device)
    reason = getattr(model.trainer, "augment_reason", "stock")
    summary["augmentation"] = "GPU" if reason == "" else f"CPU ({reason})"
    return summary


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    out = Path(args.out)
    if not args.online:  # before ultralytics is imported: it reads its config folder then
        from trainfuse.ultralytics.offline import offline_env

        offline_env(out / "yolo-config")
    data = args.data
    if data is None:
        from trainfuse.ultralytics.shapes import make_shapes_dataset

        folder = out / f"shapes-{args.imgsz}px-{args.images}-seed{args.seed}"
        data = str(make_shapes_dataset(folder, n_train=args.images, n_val=args.val_images, imgsz=args.imgsz,
                                       seed=args.seed))
    kinds = ["stock", "trainfuse"] if args.compare else ["stock"] if args.baseline else ["trainfuse"]
    runs = {kind: train(kind, args, data, out) for kind in kinds}

    from trainfuse.bench.yolo_harness import plot_runs, runs_table

    devices = sorted({r["device"] for r in runs.values()})
    print(f"\n{args.model}, batch {args.batch}, imgsz {args.imgsz}, {args.epochs} epochs on "
          f"{', '.join(devices)}")
    print(runs_table(runs))
    if any(not d.startswith("cuda") for d in devices):
        print("\non the CPU FusedDetectionTrainer falls back to torch's own kernels (no Triton, no CUDA\n"
              "graphs), so these times compare torch with itself; the speedup needs a CUDA GPU.")
    elif len(runs) == 2:
        print(f"\ntraining loop: {runs['stock']['iter_ms'] / runs['trainfuse']['iter_ms']:.2f}x faster with "
              "trainfuse")
    png = plot_runs(runs, out / "yolov5.png", title=f"{args.model} on {Path(data).parent.name}")
    (out / "summary.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                          if k != "overrides"}, "data": data, "runs": runs},
                                                 indent=1, default=str))
    print(f"plot: {png}\nsummary: {out / 'summary.json'}")
    return runs


if __name__ == "__main__":
    main(sys.argv[1:])
