"""``python -m trainfuse.bench yolo --devices 0,1``: ultralytics DDP, stock against FusedDetectionTrainer.

ultralytics trains on several GPUs by launching its own ``torch.distributed.run`` workers: the
trainer, its arguments and its callbacks are pickled into a file each rank loads. The timers ride
along as callbacks (:class:`RankZeroTimes`), and rank zero writes what it measured to a JSON file
this process reads back. Three runs, same data and seed:

- stock DDP (``DetectionTrainer``) and ours (``FusedDetectionTrainer``) on the listed GPUs, with
  ``--batch`` images per GPU (ultralytics' ``batch`` is the total; nbs=64 sets the accumulation);
- ours on the first GPU alone at ``--batch``, for the scaling: images per second of an epoch
  (data loading included) on N GPUs over 1.

Rows: the training-loop iteration (median, rank zero, GPU synchronized at both ends, so it holds
the wait for the other ranks' all-reduce) and the median epoch per implementation. The final mAP
is each run's last validation (rank zero), for a look, not a quality verdict (3 epochs by default).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainfuse.bench._common import add_row, note, print_table

SCALING_GOAL = 1.8  # images per second on 2 GPUs over 1, with ours
ITERATION_GOAL = 3.5  # ours over stock DDP


class RankZeroTimes:
    """Callbacks that time a run on every rank and write rank zero's numbers to ``path`` when
    training ends (a DDP rank's trainer is another process's object)."""

    def __init__(self, path: str | Path, batch: int) -> None:
        from trainfuse.bench.yolo_harness import LoopTimer

        self.path, self.batch, self.timer = str(path), batch, LoopTimer()

    def attach(self, model) -> RankZeroTimes:
        self.timer.attach(model)
        model.add_callback("on_train_end", self.on_train_end)
        return self

    def on_train_end(self, trainer) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        from trainfuse.bench.yolo_harness import final_map

        summary = self.timer.summary(self.batch)
        summary["map50"], summary["map50_95"] = final_map(trainer)
        summary["optimizer"] = type(trainer.optimizer).__name__
        summary["world_size"] = max(trainer.world_size, 1)
        summary["report"] = [[r.kind, r.name, r.action, r.detail] for r in getattr(trainer, "report", ())]
        summary["graphs_reason"] = getattr(trainer, "graphs_reason", None)
        summary["iter_ms_all"], summary["losses"] = self.timer.iter_ms(), self.timer.losses
        Path(self.path).write_text(json.dumps(summary))


def _run(kind: str, args, data: str, project: Path, devices: list[str]) -> dict:
    from ultralytics import YOLO

    from trainfuse.ultralytics import FusedDetectionTrainer

    name = f"{kind}-{len(devices)}gpu"
    times = project / f"{name}.json"
    times.parent.mkdir(parents=True, exist_ok=True)
    times.unlink(missing_ok=True)
    model = YOLO(args.model)
    RankZeroTimes(times, args.batch * len(devices)).attach(model)
    extra = {"trainer": FusedDetectionTrainer} if kind == "trainfuse" else {}
    model.train(data=data, epochs=args.epochs, batch=args.batch * len(devices), imgsz=args.imgsz,
                seed=args.seed, workers=args.workers, cache="ram", deterministic=False, val=False,
                plots=False, device=",".join(devices), project=str(project), name=name, exist_ok=True,
                verbose=False, optimizer=args.optimizer, **extra)
    if not times.exists():
        raise RuntimeError(f"{name}: rank zero wrote no timings to {times} (did training fail?)")
    return json.loads(times.read_text())


def run(report: dict, args, data: str, out: Path, version: str) -> None:
    """The three runs, their table and the report's rows and goals."""
    devices = [d.strip() for d in str(args.devices).split(",") if d.strip()]
    n = len(devices)
    project = out / "yolo-runs"
    runs = {"stock": _run("stock", args, data, project, devices),
            "trainfuse": _run("trainfuse", args, data, project, devices),
            "trainfuse-1gpu": _run("trainfuse", args, data, project, devices[:1])}
    workload = f"{args.model} batch {args.batch}/GPU imgsz {args.imgsz} on {n} GPUs (DDP)"
    if args.optimizer != "auto":
        workload += f" optimizer={args.optimizer}"
    for kind in ("stock", "trainfuse"):
        r = runs[kind]
        impl = "ultralytics DetectionTrainer" if kind == "stock" else "FusedDetectionTrainer"
        add_row(report, f"{workload}: training-loop iteration", impl, trainfuse=kind != "stock",
                wall_ms=r["iter_ms"])
        add_row(report, f"{workload}: epoch (data loading included)", impl, trainfuse=kind != "stock",
                wall_ms=r["epoch_s"] * 1e3)
    stock, ours, one = runs["stock"], runs["trainfuse"], runs["trainfuse-1gpu"]
    speedup = stock["iter_ms"] / ours["iter_ms"]
    scaling = one["epoch_s"] / ours["epoch_s"]  # an epoch is the same images, split over the ranks
    scaling_iter = one["iter_ms"] / ours["iter_ms"] * n
    rows = [[kind, r["world_size"], r["optimizer"], f"{r['iter_ms']:.2f}", f"{r['data_wait_ms']:.2f}",
             f"{r['epoch_s']:.2f}", "-" if r["map50"] is None else f"{r['map50']:.3f}",
             r.get("graphs_reason") or ("on" if kind != "stock" else "-")] for kind, r in runs.items()]
    print_table(f"\n{workload}, {args.epochs} epoch(s), ultralytics {version}",
                ["run", "GPUs", "optimizer", "iter ms", "data wait ms", "epoch s", "mAP50", "graphs"], rows)
    goals = {"iteration": speedup >= ITERATION_GOAL, "scaling": scaling >= SCALING_GOAL}
    if stock["map50"] is not None and ours["map50"] is not None:  # a look: one seed, --epochs epochs
        goals["map50_within_1_point"] = abs(ours["map50"] - stock["map50"]) <= 0.01
    print_table("speed", ["", "value", "goal"], [
        ["iteration, ours over stock DDP", f"{speedup:.2f}x", f">= {ITERATION_GOAL}x"],
        [f"images/s of an epoch, ours on {n} GPUs over 1", f"{scaling:.2f}x", f">= {SCALING_GOAL}x"],
        [f"images/s of the loop (iterations), ours on {n} GPUs over 1", f"{scaling_iter:.2f}x", "-"]])
    for kind, r in runs.items():
        for row in r.get("report", []):
            if row[0] in ("ddp", "casts", "graphs"):
                note(report, f"{kind}: {row[3]}")
    report["goals"] = goals
    report["scaling"] = {"epoch_images_per_s": scaling, "loop_images_per_s": scaling_iter,
                         "one_gpu": {k: one[k] for k in ("iter_ms", "epoch_s", "data_wait_ms")}}
    report["runs"] = {k: {key: v for key, v in r.items() if key not in ("iter_ms_all", "losses", "report")}
                      for k, r in runs.items()}
    report["curves"] = {k: {"losses": r["losses"], "iter_ms": r["iter_ms_all"]} for k, r in runs.items()}
    report["summary_skip"] = [f"{workload}: epoch (data loading included)"]
    report["settings"] = {"model": args.model, "optimizer": args.optimizer, "batch_per_gpu": args.batch,
                          "devices": devices, "imgsz": args.imgsz, "epochs": args.epochs,
                          "images": args.images, "workers": args.workers, "seed": args.seed,
                          "ultralytics": version}


__all__ = ["ITERATION_GOAL", "SCALING_GOAL", "RankZeroTimes", "run"]
