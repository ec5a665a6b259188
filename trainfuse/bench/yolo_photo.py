"""``python -m trainfuse.bench yolo --photo``: training on photo-like JPEGs that the loader decodes
and augments every epoch (``cache=False``, ultralytics' default workers), where the loader, not the
step, can set the pace.

The images are :func:`trainfuse.ultralytics.shapes.make_shapes_dataset` with ``photo=True``:
640 x 480 with a photo's grain, about 190 KB each as JPEG (COCO's mean is about 160-195 KB). Per
run: images per second in the steady state (from the end of the first epoch to the end of the last,
steps, data waits and epoch ends included), for

- ultralytics' training loader alone (the same dataset, augmentation and workers as the trainer,
  iterated with no GPU work), epoch by epoch; and the same loader with the augmentation deferred to
  the GPU (its workers decode, paste the mosaic and crop: what feeds ``gpu_augment``);
- the stock ``DetectionTrainer``, ``FusedDetectionTrainer`` with ``gpu_augment=False``
  (augmentation in the loader's workers, as ultralytics does) and as it comes (here, with
  ``cache=False`` on CUDA: decoding and augmentation on the GPU), trained alike;

and each trainer's median iteration and data wait. What its loader alone delivers bounds each trainer.
The trainers' loops run as a user's (``train_run(..., unsynced=True)``): no GPU sync at each
iteration and no profiled iterations, which would stop the host from queueing ahead and the
decoding thread's GPU work from overlapping the step; the iteration and data-wait medians are then
host times.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from trainfuse.bench._common import add_row, note, print_table


def loader_rates(data: str, imgsz: int, batch: int, workers: int, epochs: int = 3, deferred: bool = False,
                 decode: bool = False) -> list[float]:
    """Images per second of ultralytics' training loader alone, one number per epoch; ``deferred``:
    with the warp, HSV and flips left for the GPU (:mod:`trainfuse.ultralytics.augment.deferred`),
    and with ``decode`` the JPEGs' decoding too (what feeds ``gpu_augment`` on CUDA)."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset
    from ultralytics.data.utils import check_det_dataset

    cfg = get_cfg(overrides={"imgsz": imgsz, "cache": False})
    info = check_det_dataset(data)
    dataset = build_yolo_dataset(cfg, info["train"], batch, info, mode="train", stride=32)
    if deferred:
        from trainfuse.ultralytics.augment import deferred as deferral

        deferral.install(dataset, cfg, pad=True, decode=decode)
    # the trainer's device: ultralytics pins the batches and sizes the worker pool by it
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    loader = build_dataloader(dataset, batch, workers, shuffle=True, rank=-1, device=device)
    rates = []
    for _ in range(epochs):
        start, n = time.perf_counter(), 0
        for b in loader:
            n += len(b["im_file"])
        rates.append(n / (time.perf_counter() - start))
    return rates


def run(report: dict, args, data: str, out: Path, version: str) -> None:
    """Measure the loader alone, then stock and ours, into ``report``."""
    from trainfuse.bench.yolo_harness import train_run

    jpegs = (Path(data).parent / "images" / "train").glob("*.jpg")
    kb = sum(p.stat().st_size for p in jpegs) / args.images / 1024
    epochs = min(3, max(args.epochs, 1))
    rates = loader_rates(data, args.imgsz, args.batch, args.workers, epochs=epochs)
    deferred_rates = loader_rates(data, args.imgsz, args.batch, args.workers, epochs=epochs, deferred=True,
                                  decode=True)
    # ultralytics turns the mosaic off for the last close_mosaic (10) epochs: a short run keeps it on,
    # as most epochs of a real one have it
    train_args = {"close_mosaic": 0} if args.epochs <= 10 else {}
    runs, reasons = {}, {}
    for kind, name, kwargs in (("stock", "stock", {}),
                               ("trainfuse", "trainfuse-cpu-augment", {"gpu_augment": False}),
                               ("trainfuse", "trainfuse", {})):
        runs[name], trainer = train_run(kind, args, data, out / "yolo-runs", device=args.devices, cache=False,
                                        name=name, train_args=train_args, unsynced=True, **kwargs)
        reasons[name] = getattr(trainer, "augment_reason", "stock")
    workload = (f"{args.model} batch {args.batch} imgsz {args.imgsz}, {args.images} photo-like JPEGs "
                f"({kb:.0f} KB), cache off, {args.workers} workers: images/s in the steady state")
    per_s = {kind: r["steady_images_per_s"] for kind, r in runs.items()}
    by_epoch = [" / ".join(f"{r:.0f}" for r in rates), " / ".join(f"{r:.0f}" for r in deferred_rates)]
    rows = [["loader alone (no GPU work)", by_epoch[0], "", "", "", ""],
            ["loader alone, decoding and augmentation left to the GPU", by_epoch[1], "", "", "", ""]]
    for kind, r in runs.items():
        rows.append([kind, f"{per_s[kind]:.0f}", f"{args.images / r['epoch_s']:.0f}", f"{r['iter_ms']:.2f}",
                     f"{r['data_wait_ms']:.2f}", f"{r.get('prefetch_host_ms', float('nan')):.2f}"])
    print_table(workload, ["run", "images/s (steady)", "images/s (epoch)", "iteration host ms (median)",
                           "data wait ms (median)", "prefetch host ms"], rows)
    add_row(report, workload, "ultralytics DetectionTrainer", trainfuse=False, wall_ms=1e3 / per_s["stock"])
    add_row(report, workload, "FusedDetectionTrainer, gpu_augment=False", trainfuse=True,
            wall_ms=1e3 / per_s["trainfuse-cpu-augment"])
    add_row(report, workload, "FusedDetectionTrainer (its default here: augmentation on the GPU)",
            trainfuse=True, wall_ms=1e3 / per_s["trainfuse"])
    note(report, "ms per image in the steady state: images over the time from the end of the first epoch to "
                 "the end of the last, the epoch ends (checkpoints; validation is off) included, so the "
                 "batches the workers make ahead meanwhile are paid for")
    note(report, "the trainers' loops run as a user's: no GPU sync at each iteration and no profiled "
                 "iterations (the iteration and data-wait medians are host times)")
    note(report, f"the loader alone: {by_epoch[0]} images/s by epoch, with the decoding and augmentation "
                 f"left to the GPU: {by_epoch[1]}")
    if train_args:
        note(report, "mosaic on in every epoch (close_mosaic=0): a short run measures what most epochs of a "
                     "long one do")
    note(report, "augmentation: " + "; ".join(f"{k}: {'on the GPU' if not v else 'CPU (' + v + ')'}"
                                                for k, v in reasons.items()))
    report["summary_skip"] = [workload]  # in the docs' table; the README's keeps the iteration rows
    report["runs"] = {k: {key: v for key, v in r.items() if key not in ("losses", "iter_ms_all")}
                      for k, r in runs.items()}
    report["loader_images_per_s"] = rates
    report["deferred_loader_images_per_s"] = deferred_rates
    report["settings"] = {"model": args.model, "batch": args.batch, "imgsz": args.imgsz,
                          "epochs": args.epochs, "images": args.images, "jpeg_kb": kb,
                          "workers": args.workers, "cache": False, "seed": args.seed, "ultralytics": version}


__all__ = ["loader_rates", "run"]
