"""EMA benchmark: ultralytics ModelEMA (per-tensor loop and _foreach_lerp_) against FusedEMA, on
GPT-2 124M (float32) and yolov5n (params and BatchNorm buffers), with the bandwidth floor."""

from __future__ import annotations

import os

import torch
from torch import nn

import trainfuse
from trainfuse.bench._common import (
    bench_parser,
    kernel_ms,
    parse_and_start,
    print_table,
    save_report,
    wall_ms,
)
from trainfuse.bench.optim import gpt2_shapes


class _Params(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in shapes)


def _models():
    out = [("GPT-2 124M", _Params(gpt2_shapes()).cuda())]
    try:
        os.environ.setdefault("YOLO_OFFLINE", "1")
        from ultralytics.nn.tasks import DetectionModel

        out.append(("yolov5n", DetectionModel("yolov5n.yaml", verbose=False).cuda()))
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        print("ultralytics not installed: yolov5n row skipped")
    return out


def _bench(name, model, bw):
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
             "trainfuse FusedEMA.update": lambda: ours.update(model)}
    res = {k: (kernel_ms(fn), wall_ms(fn)) for k, fn in impls.items()}
    base = res[foreach]
    rows = [[k, f"{kk:.3f}", f"{w:.3f}", f"{floor / kk * 100:.0f}%", f"{floor / w * 100:.0f}%",
             f"{base[1] / w:.2f}x"] for k, (kk, w) in res.items()]
    print_table(f"EMA update, {name}: {nel / 1e6:.1f}M elements in {len(pairs)} tensors, floor "
                f"{floor:.3f} ms (12 B/element)",
                ["impl", "kernel ms", "wall ms", "% floor (kernel)", "% floor (wall)",
                 "vs _foreach_lerp_ (wall)"], rows)
    return {"floor_ms": floor, "tensors": len(pairs), "results": res}


def main(argv=None):
    started = parse_and_start(bench_parser(__doc__), argv, "EMA")
    if started is None:
        return
    args, report, bw = started
    report["workloads"] = {}
    for name, model in _models():
        report["workloads"][name] = _bench(name, model, bw)
    save_report(report, args.out, "ema")


__all__ = ["main"]
