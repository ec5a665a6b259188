"""EMA benchmark: ultralytics ModelEMA (per-tensor loop and _foreach_lerp_) against FusedEMA, on
GPT-2 124M (float32) and yolov5n (params and BatchNorm buffers), with the bandwidth floor.
Workloads from trainfuse.bench.workloads."""

from __future__ import annotations

import torch

import trainfuse
from trainfuse.bench._common import (
    add_row,
    bench_parser,
    kernel_ms,
    note,
    parse_and_start,
    print_table,
    save_report,
    wall_ms,
)
from trainfuse.bench.workloads import ParamShapes, gpt2_shapes, yolov5n

OURS = "trainfuse FusedEMA.update"


def _models(report):
    out = [("GPT-2 124M", ParamShapes(gpt2_shapes()).cuda())]
    y5 = yolov5n()
    if y5 is not None:
        out.append(("yolov5n", y5))
    else:
        note(report, "ultralytics not installed: yolov5n row skipped")
    return out


def _bench(report, name, model, bw):
    pairs = [v for v in model.state_dict().values() if v.dtype.is_floating_point]
    nel = sum(v.numel() for v in pairs)
    floor = 12 * nel / bw * 1e3  # read ema and model, write ema
    ours = trainfuse.FusedEMA(model)
    ema_v = [v for v in ours.ema.state_dict().values() if v.dtype.is_floating_point]
    d = 0.9999

    def loop():
        for v, m in zip(ema_v, pairs):
            v.mul_(d).add_(m, alpha=1 - d)

    foreach = "_foreach_lerp_ (ultralytics 8.4 ModelEMA)"
    impls = {"per-tensor loop (ultralytics < 8.4)": loop,
             foreach: lambda: torch._foreach_lerp_(ema_v, pairs, 1 - d),
             OURS: lambda: ours.update(model)}
    res = {k: (kernel_ms(fn), wall_ms(fn)) for k, fn in impls.items()}
    base = res[foreach]
    rows = [[k, f"{kk:.3f}", f"{w:.3f}", f"{floor / kk * 100:.0f}%", f"{floor / w * 100:.0f}%",
             f"{base[1] / w:.2f}x"] for k, (kk, w) in res.items()]
    print_table(f"EMA update, {name}: {nel / 1e6:.1f}M elements in {len(pairs)} tensors, floor "
                f"{floor:.3f} ms (12 B/element)",
                ["impl", "kernel ms", "wall ms", "% floor (kernel)", "% floor (wall)",
                 "vs _foreach_lerp_ (wall)"], rows)
    label = f"EMA update, {name} ({len(pairs)} tensors, {nel / 1e6:.1f}M elements)"
    for k, (kk, w) in res.items():
        add_row(report, label, k, trainfuse=k == OURS, do_bench_ms=kk, wall_ms=w, floor_ms=floor)


def main(argv=None):
    started = parse_and_start(bench_parser(__doc__), argv, "EMA")
    if started is None:
        return
    args, report, bw = started
    for name, model in _models(report):
        _bench(report, name, model, bw)
    save_report(report, args.out, "ema")


__all__ = ["main"]
