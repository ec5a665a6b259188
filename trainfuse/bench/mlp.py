"""MLP benchmark: ``Linear + activation`` chains, forward + backward under bf16 autocast, as
../shared/bench/anchors.py measures them (``mlp(x).float().sum().backward()``, float32 params and
input): eager torch, torch.compile, and FusedMLP with one and with two streams. TFLOP/s counts the
three matmuls per layer (forward, input grad, weight grad).

``--sweep`` times each matmul of the chain (forward, dgrad, wgrad) alone for candidate tile shapes
and prints the best per shape: how the defaults in ``trainfuse.nn.mlp.config`` were picked."""

from __future__ import annotations

import argparse
import copy
import os

import torch

from trainfuse.bench._common import kernel_ms, print_table, save_report, start_report, wall_ms
from trainfuse.nn import FusedMLP
from trainfuse.nn import mlp as M

# (name, batch, width, layers, activation, dropout): the anchors' three shapes, then GELU and dropout
WORKLOADS = [("relu B=8192 D=1024", 8192, 1024, 4, "relu", 0.0),
             ("relu B=65536 D=256", 65536, 256, 4, "relu", 0.0),
             ("relu B=2048 D=4096", 2048, 4096, 4, "relu", 0.0),
             ("gelu B=8192 D=1024", 8192, 1024, 4, "gelu", 0.0),
             ("relu+dropout0.1 B=8192 D=1024", 8192, 1024, 4, "relu", 0.1)]

SWEEP = ["128x128x64w8s3", "128x256x64w8s3", "128x128x64w4s4", "64x128x64w4s4", "128x64x64w4s4",
         "256x128x64w8s3", "64x64x64w4s4", "128x128x32w4s5"]


def parse_config(text: str) -> M.MatmulConfig:
    """``"BMxBNxBKwWARPSsSTAGES"`` (e.g. ``128x128x64w8s3``) as a MatmulConfig."""
    tiles, rest = text.split("w")
    warps, stages = rest.split("s")
    bm, bn, bk = (int(v) for v in tiles.split("x"))
    return M.MatmulConfig(bm, bn, bk, int(warps), int(stages))


def _step(mlp, x):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mlp(x).float().sum().backward()
    return step


def _sweep(batch, width, rows):
    """Each of the three matmuls alone, per candidate tile shape (bf16 compute, float32 weight as
    under autocast; activations bf16)."""
    dev = "cuda"
    w = torch.randn(width, width, device=dev) * width ** -0.5
    b = torch.randn(width, device=dev)
    x = torch.randn(batch, width, device=dev, dtype=torch.bfloat16)
    g = torch.randn(batch, width, device=dev, dtype=torch.bfloat16)
    out = torch.empty(batch, width, device=dev, dtype=torch.bfloat16)
    gw, gb = torch.empty_like(w), torch.empty_like(b)
    flops = 2 * batch * width * width
    ops = {"forward": lambda: M.matmul(x, w.t(), out, torch.bfloat16, M.EPI_FORWARD, act=1, bias=b),
           "dgrad": lambda: M.matmul(g, w, out, torch.bfloat16, M.EPI_ACT_GRAD, act=1, aux=x),
           "wgrad": lambda: M.matmul(g.t(), x, gw, torch.bfloat16, M.EPI_WGRAD, db=gb)}
    saved = copy.deepcopy(M.config)
    best = {}
    try:
        for op, fn in ops.items():
            for text in SWEEP:
                setattr(M.config, op, parse_config(text))
                try:
                    fn()
                    ms = kernel_ms(fn)
                except Exception as e:  # noqa: BLE001 - a tile shape may not fit this GPU
                    rows.append([f"B={batch} D={width}", op, text, "ERR", str(e).splitlines()[0][:50]])
                    continue
                rows.append([f"B={batch} D={width}", op, text, f"{ms:.4f}", f"{flops / ms / 1e9:.0f}"])
                if op not in best or ms < best[op][1]:
                    best[op] = (text, ms)
            setattr(M.config, op, getattr(saved, op))
    finally:
        M.config = saved
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the json")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--sweep", action="store_true", help="time tile shapes per matmul first")
    parser.add_argument("--only", default="", help="run only workloads whose name contains this")
    args = parser.parse_args(argv)
    started = start_report("MLP")
    if started is None:
        return
    report, _ = started
    if args.sweep:
        rows, report["sweep"] = [], {}
        for _, batch, width, *_ in WORKLOADS[:3]:
            report["sweep"][f"B={batch} D={width}"] = _sweep(batch, width, rows)
        print_table("tile sweep, one matmul (bf16, float32 weight)",
                    ["shape", "op", "tiles", "ms", "TFLOP/s"], rows)
        for shape, best in report["sweep"].items():
            print(shape, {op: f"{t} {ms:.4f}" for op, (t, ms) in best.items()})
    rows, report["mlp"] = [], {}
    for name, batch, width, depth, act, p in WORKLOADS:
        if args.only not in name:
            continue
        torch.manual_seed(0)
        seq = FusedMLP([width] * (depth + 1), activation=act, last_activation=True, dropout=p).cuda()
        eager = torch.nn.Sequential(*seq.children())
        x = torch.randn(batch, width, device="cuda")
        flops = 3 * 2 * batch * width * width * depth
        impls = {"eager": eager}
        if not args.no_compile:
            impls["torch.compile"] = torch.compile(eager)
        impls["trainfuse streams=1"] = FusedMLP.from_sequential(eager, streams=1)
        impls["trainfuse streams=2"] = FusedMLP.from_sequential(eager, streams=2)
        res = {}
        for label, mod in impls.items():
            fn = _step(mod, x)
            try:
                fn()
                k, w = kernel_ms(fn), wall_ms(fn, iters=50)
            except Exception as e:  # noqa: BLE001 - torch.compile may fail on a machine; report it
                rows.append([name, label, "ERR", str(e).splitlines()[0][:60], "", ""])
                continue
            res[label] = {"do_bench_ms": k, "wall_ms": w, "tflops": flops / k / 1e9}
            rows.append([name, label, f"{k:.3f}", f"{w:.3f}", f"{flops / k / 1e9:.0f}", ""])
        base = res.get("eager", {}).get("do_bench_ms")
        for row in rows[-len(res):]:
            if base and row[1] in res:
                row[5] = f"{base / res[row[1]]['do_bench_ms']:.2f}x eager"
        report["mlp"][name] = res
        for p_ in eager.parameters():
            p_.grad = None
    print_table("MLP forward + backward, bf16 autocast, float32 params (do_bench median)",
                ["workload", "implementation", "do_bench ms", "wall ms", "TFLOP/s", "vs eager"], rows)
    save_report(report, args.out, "mlp")


if __name__ == "__main__":
    main()
