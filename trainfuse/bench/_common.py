"""Timing helpers shared by the benchmarks: kernel time, wall time with host work, bandwidth."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


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
    """Device copy bandwidth in bytes/s (read + write), as ../shared/bench/anchors.py measures."""
    n = 1 << 28
    a = torch.empty(n, device="cuda")
    b = torch.empty(n, device="cuda")
    ms = kernel_ms(lambda: b.copy_(a))
    return 2 * n * 4 / (ms * 1e-3)


def start_report(what: str) -> tuple[dict, float] | None:
    """Say what runs here; without a GPU say that there is nothing to measure and return None.
    Otherwise measure the copy bandwidth and return ``(report, bytes/s)``, the report holding the
    device, the versions and the bandwidth."""
    import triton

    from trainfuse import describe

    print(describe())
    if not torch.cuda.is_available():
        print(f"the {what} benchmark needs a CUDA GPU; nothing to measure here")
        return None
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_GBps": bw / 1e9}
    return report, bw


def save_report(report: dict, out: str, name: str) -> None:
    """Write ``report`` as ``out/bench_<name>.json``."""
    import json
    import os

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"bench_{name}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def bench_parser(doc: str, *, no_compile: bool = False, only: str | None = None) -> argparse.ArgumentParser:
    """The command line every ``python -m trainfuse.bench X`` shares: ``--out`` (the report's
    folder, default ``$OUT`` or ``.``), optionally ``--no-compile`` (leave torch.compile rows out)
    and ``--only`` (with ``only`` as its help); the benchmark adds its own options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the report")
    if no_compile:
        parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    if only is not None:
        parser.add_argument("--only", default="", help=only)
    return parser


def parse_and_start(parser: argparse.ArgumentParser, argv, what: str
                    ) -> tuple[argparse.Namespace, dict, float] | None:
    """Parse ``argv`` and :func:`start_report`: ``(args, report, copy bandwidth)``, or None where
    there is no GPU to measure on."""
    args = parser.parse_args(argv)
    started = start_report(what)
    return None if started is None else (args, *started)
