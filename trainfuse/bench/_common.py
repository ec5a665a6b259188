"""The benchmark harness: timing, the results report and the command line every
``python -m trainfuse.bench <family>`` shares.

Each family is a line of :data:`FAMILIES` (its name on the command line, its module, what it
measures) and a module with ``main(argv)``. A family module parses its options with
:func:`bench_parser` and :func:`parse_and_start`, times its workloads with :func:`kernel_ms`,
:func:`wall_ms`, :func:`host_ms` or :func:`graph_ms`, prints tables with :func:`print_table`,
records one row per (workload, implementation) with :func:`add_row` and writes the report with
:func:`save_report`. The report file is
``<out>/<family>.json`` with this schema (``benchmarks/render.py`` turns it into the README's and
the docs' tables)::

    {"schema": 1, "family": "optim", "command": "python -m trainfuse.bench optim --no-compile",
     "device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "trainfuse": "0.1.0",
     "date": "2026-11-24", "copy_GBps": 4223.1,
     "headline": "wall_ms",                      # the metric the README compares
     "metrics": {"wall_ms": "what it means", ...},
     "notes": ["ultralytics not installed: yolov5n row skipped"],
     "rows": [{"workload": "...", "impl": "torch fused", "trainfuse": false,
               "wall_ms": 1.026, "floor_ms": 0.825, ...}, ...],
     "details": {...}}                           # anything else the family measured

Within a workload the first row with ``"trainfuse": true`` is the configuration the README
compares against the fastest torch row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

SCHEMA = 1

# Every metric a row may carry: the report lists the ones its rows use, with these meanings.
METRICS = {
    "do_bench_ms": "median of triton.testing.do_bench (L2 flushed before each call; host work "
                   "longer than the flush shows up in it)",
    "wall_ms": "back-to-back calls synchronized at the end: what a training loop pays per call, "
               "host work included",
    "host_ms": "host time of one call, the GPU not waited for",
    "graph_ms": "the call captured in a CUDA graph and replayed: the GPU's own time",
    "phase_ms": "wall ms less the host time of re-attaching the grads between calls",
    "floor_ms": "bytes the call must move over the measured device copy bandwidth",
    "tflops": "TFLOP/s of the matmuls over do_bench ms",
    "map50": "mAP at IoU 0.5 of the final validation, mean over the training seeds",
    "map50_95": "mAP over IoU 0.5 to 0.95 of the final validation, mean over the training seeds",
    "box_map50_95": "the boxes' mAP over IoU 0.5 to 0.95 of a segmentation or pose run's final validation, "
                    "mean over the training seeds",
}

# family on the command line -> (its module, what it measures)
FAMILIES = {
    "optim": ("trainfuse.bench.optim",
              "optimizer step, torch (for-loop, foreach, fused, compiled) against trainfuse"),
    "amp": ("trainfuse.bench.amp",
            "mixed precision: cast fusion, fused clipping, ultralytics' optimizer phase"),
    "ema": ("trainfuse.bench.ema",
            "EMA update: ultralytics ModelEMA against FusedEMA, by model and by tensor count"),
    "losses": ("trainfuse.bench.losses",
               "CIoU loss and BCE-with-logits, forward + backward: eager, torch.compile, trainfuse"),
    "mlp": ("trainfuse.bench.mlp",
            "Linear + activation chains, forward + backward: eager, torch.compile, FusedMLP"),
    "yolo-loss": ("trainfuse.bench.yolo_loss",
                  "YOLO detection loss, forward + backward: v8DetectionLoss / E2ELoss against fused ones"),
    "stem": ("trainfuse.bench.stem",
             "a detector's first convolution, forward + weight grad: conv2d against the space-to-depth fold"),
    "muon": ("trainfuse.bench.muon",
             "a Muon step over GPT-2's hidden matrices: torch.optim.Muon against FusedMuon"),
    "blocks": ("trainfuse.bench.blocks",
               "a Conv block's BatchNorm2d and SiLU, forward + backward: torch against batch_norm_silu"),
    "augment": ("trainfuse.bench.augment",
                "YOLO augmentation of a batch (warp, HSV, flip): ultralytics on the CPU against one kernel"),
    "yolo": ("trainfuse.bench.yolo",
             "YOLOv5 training: ultralytics' DetectionTrainer against FusedDetectionTrainer"),
    "yolo-quality": ("trainfuse.bench.yolo_quality",
                     "YOLO training quality: mAP of stock against FusedDetectionTrainer over models, "
                     "optimizers and seeds"),
    "lightning": ("trainfuse.bench.lightning",
                  "Lightning training steps: stock against FusedTraining, with and without CUDA graphs"),
}

# keys of the report that are part of the schema; everything else is saved under "details"
_TOP = ("schema", "family", "command", "device", "torch", "triton", "trainfuse", "date", "copy_GBps",
        "headline", "metrics", "notes", "rows")


def kernel_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median of triton.testing.do_bench (device events, L2 flushed between calls). The flush
    kernel runs before each call, so part of the host time hides behind it: see :func:`wall_ms`."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def wall_ms(fn, iters: int = 200, repeats: int = 5) -> float:
    """Back-to-back calls, synchronized at the end: what a training loop pays per call, host work
    included (median over ``repeats`` runs of ``iters`` calls)."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(runs)


def host_ms(fn, iters: int = 200) -> float:
    """Median host time of one call (launch work only, the GPU is not waited for)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times)


def graph_ms(fn, repeat: int = 1) -> float:
    """``repeat`` calls of fn captured in a CUDA graph and replayed (per replay): the GPU's own
    time, with the host's launch work (Python, autograd) taken out, which would otherwise hide
    a short kernel's time in :func:`kernel_ms`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return kernel_ms(graph.replay)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write) of a 1 GiB float32 copy: the floor every
    memory-bound row is compared with."""
    n = 1 << 28
    a = torch.empty(n, device="cuda")
    b = torch.empty(n, device="cuda")
    ms = kernel_ms(lambda: b.copy_(a))
    return 2 * n * 4 / (ms * 1e-3)


def new_report(device: str, copy_GBps: float | None) -> dict:
    """An empty report for ``device``: the versions of torch, triton and trainfuse and today's date
    (UTC).

    Args:
        device: the GPU's name, as ``torch.cuda.get_device_name()`` gives it.
        copy_GBps: the measured device copy bandwidth in GB/s, or None.

    Returns:
        the report dict :func:`add_row` and :func:`save_report` take.
    """
    import triton

    import trainfuse

    return {"schema": SCHEMA, "device": device, "torch": torch.__version__, "triton": triton.__version__,
            "trainfuse": trainfuse.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "copy_GBps": copy_GBps, "headline": "wall_ms", "notes": [], "rows": []}


def start_report(what: str) -> tuple[dict, float] | None:
    """Say what runs here; without a GPU say that there is nothing to measure and return None.
    Otherwise measure the copy bandwidth and return ``(report, bytes/s)``, the report holding the
    device, the versions, the date and the bandwidth."""
    from trainfuse import describe

    print(describe())
    if not torch.cuda.is_available():
        print(f"the {what} benchmark needs a CUDA GPU; nothing to measure here")
        return None
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    return new_report(torch.cuda.get_device_name(), bw / 1e9), bw


def add_row(report: dict, workload: str, impl: str, *, trainfuse: bool, **metrics: float | None) -> None:
    """Record one implementation's timings of one workload.

    Args:
        report: the report from :func:`start_report`.
        workload: what was timed, the same string for every implementation of it.
        impl: the implementation ("torch fused", "trainfuse", ...).
        trainfuse: whether ``impl`` is ours (the README compares the first such row of a workload
            with the fastest other one).
        metrics: keys of :data:`METRICS` and their values (None where not measured).
    """
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"add_row: unknown metrics {sorted(unknown)}; expected keys of METRICS")
    report["rows"].append({"workload": workload, "impl": impl, "trainfuse": trainfuse, **metrics})


def note(report: dict, text: str) -> None:
    """Print ``text`` and keep it in the report's notes (a skipped row, a missing package)."""
    print(text)
    report.setdefault("notes", []).append(text)


def save_report(report: dict, out: str, name: str) -> None:
    """Write ``report`` as ``out/<name>.json`` in the schema of this module's docstring: the
    schema's keys at the top, every other key the family set under ``"details"``."""
    report = dict(report)
    report.setdefault("rows", [])
    report["family"] = name
    bench = report.pop("_bench", name)  # the family on the command line, where it differs from name
    report["command"] = " ".join(["python -m trainfuse.bench", bench, *_without_out(report.pop("_argv", []))])
    used = {k for row in report["rows"] for k in row} & set(METRICS)
    report["metrics"] = {k: v for k, v in METRICS.items() if k in used}
    doc = {k: report[k] for k in _TOP if k in report}
    details = {k: v for k, v in report.items() if k not in _TOP}
    if details:
        doc["details"] = details
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    print(f"saved {path}")


def format_columns(header: list[str], rows: list[list]) -> str:
    """``rows`` under ``header`` and a rule, in columns as wide as their widest cell."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    cells.insert(1, ["-" * w for w in widths])
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """Print ``title``, then ``rows`` under ``header`` in aligned columns."""
    print(f"\n{title}")
    print(format_columns(header, rows))


def bench_parser(family: str, doc: str, *, no_compile: bool = False,
                 only: str | None = None) -> argparse.ArgumentParser:
    """The command line every ``python -m trainfuse.bench <family>`` shares: ``--out`` (the
    report's folder, default ``$OUT`` or ``.``), optionally ``--no-compile`` (leave torch.compile
    rows out) and ``--only`` (with ``only`` as its help); the benchmark adds its own options.

    Args:
        family: the name on the command line (a key of :data:`FAMILIES`), shown in the usage line.
        doc: the family module's docstring; its first line describes the benchmark.
    """
    if family not in FAMILIES:
        raise ValueError(f"bench_parser: family {family!r} is not one of {sorted(FAMILIES)}")
    parser = argparse.ArgumentParser(prog=f"python -m trainfuse.bench {family}",
                                     description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."),
                        help="folder for the report <family>.json (benchmarks/results/<gpu> to refresh "
                             "the committed results)")
    if no_compile:
        parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    if only is not None:
        parser.add_argument("--only", default="", help=only)
    return parser


def _without_out(argv: list[str]) -> list[str]:
    """``argv`` less ``--out DIR`` / ``--out=DIR`` (a machine's folder is no part of the command)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            kept.append(a)
    return kept


def parse_and_start(parser: argparse.ArgumentParser, argv, what: str
                    ) -> tuple[argparse.Namespace, dict, float] | None:
    """Parse ``argv`` and :func:`start_report`: ``(args, report, copy bandwidth)``, or None where
    there is no GPU to measure on. The report remembers the options for its ``command``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    started = start_report(what)
    if started is None:
        return None
    report, bw = started
    report["_argv"] = argv
    return args, report, bw
