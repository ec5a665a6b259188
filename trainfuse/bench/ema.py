"""EMA benchmark: ultralytics ModelEMA (per-tensor loop and _foreach_lerp_) against FusedEMA, on
GPT-2 124M (float32) and yolov5n (params and BatchNorm buffers), with the bandwidth floor; and
_foreach_lerp_ against FusedEMA from 1 to 5,000 tensors holding 9.6M float32 elements together
(where host time decides). Workloads from trainfuse.bench.workloads."""

from __future__ import annotations

import torch

import trainfuse
from trainfuse.bench._common import (
    add_row,
    bench_parser,
    host_ms,
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


SWEEP_COUNTS = (1, 4, 16, 64, 256, 1024, 5000)
SWEEP_ELEMENTS = 4 * 2_400_000


def _sweep_one(report, bw, n: int) -> list:
    """_foreach_lerp_ against FusedEMA.update on ``n`` equal float32 tensors: one table row."""
    model = ParamShapes([(SWEEP_ELEMENTS // n,)] * n).cuda()
    pairs = list(model.state_dict().values())
    nel = sum(v.numel() for v in pairs)
    floor = 12 * nel / bw * 1e3
    ours = trainfuse.FusedEMA(model)
    ema_v = list(ours.ema.state_dict().values())
    impls = {"_foreach_lerp_": lambda: torch._foreach_lerp_(ema_v, pairs, 1e-4),
             OURS: lambda: ours.update(model)}
    res = {k: (kernel_ms(fn), wall_ms(fn), host_ms(fn)) for k, fn in impls.items()}
    label = f"EMA update, {n} float32 tensor{'s' if n > 1 else ''} ({nel / 1e6:.1f}M elements)"
    for k, (kk, w, h) in res.items():
        add_row(report, label, k, trainfuse=k == OURS, do_bench_ms=kk, wall_ms=w, host_ms=h,
                floor_ms=floor)
    (fk, fw, fh), (ok, ow, oh) = res["_foreach_lerp_"], res[OURS]
    return [n, f"{fw:.4f}", f"{ow:.4f}", f"{fw / ow:.2f}x", f"{fh:.4f}", f"{oh:.4f}", f"{fk:.4f}",
            f"{ok:.4f}", f"{floor / ok * 100:.0f}%"]


def _sweep(report, bw):
    rows = [_sweep_one(report, bw, n) for n in SWEEP_COUNTS]
    # the README's summary keeps the two model rows; the sweep is in docs/performance.md
    report["summary_skip"] = list(dict.fromkeys(r["workload"] for r in report["rows"]
                                                if "float32 tensor" in r["workload"]))
    print_table(f"EMA update by tensor count, {SWEEP_ELEMENTS / 1e6:.1f}M float32 elements in all",
                ["tensors", "foreach wall ms", "ours wall ms", "speedup (wall)", "foreach host ms",
                 "ours host ms", "foreach kernel ms", "ours kernel ms", "ours % floor (kernel)"], rows)


def main(argv=None):
    started = parse_and_start(bench_parser("ema", __doc__), argv, "EMA")
    if started is None:
        return
    args, report, bw = started
    for name, model in _models(report):
        _bench(report, name, model, bw)
    _sweep(report, bw)
    save_report(report, args.out, "ema")


__all__ = ["main"]
