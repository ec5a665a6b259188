"""MLP benchmark: ``Linear + activation`` chains, forward + backward under bf16 autocast
(``mlp(x).float().sum().backward()``, float32 params and input; shapes in
trainfuse.bench.workloads.MLP_WORKLOADS): eager torch, torch.compile, and FusedMLP with one and
with two streams (and, for GELU, recomputing the activation's derivative in the backward). The row
"trainfuse cuBLAS matmuls" is the ReLU chain with ``trainfuse.nn.mlp.config.library = True``
(cuBLAS's matmuls, our fused mask and bias-grad pass).
TFLOP/s counts the three matmuls per layer (forward, input grad, weight grad).

By default nothing resets the grads between steps: each backward adds its param grads to
the last step's (autograd: one add kernel per param; FusedMLP: inside its weight-grad kernels,
``fuse_grad_accumulation``). The row "grads via autograd" is FusedMLP (one stream) with that
switched off. ``--set-to-none`` instead sets every grad to None before each step (a training
loop's ``zero_grad()``): nothing to accumulate, for eager or us.

``--sweep`` times each matmul of the chain (forward, dgrad, wgrad) alone for candidate tile shapes
and prints the best per shape: how the defaults in ``trainfuse.nn.mlp.config`` were picked."""

from __future__ import annotations

import copy

import torch

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    graph_ms,
    host_ms,
    kernel_ms,
    note,
    parse_and_start,
    print_table,
    save_report,
    wall_ms,
)
from trainfuse.bench.workloads import MLP_WORKLOADS
from trainfuse.nn import FusedMLP
from trainfuse.nn.mlp import launches as M

# t: operands through TMA descriptors, p: through pointers; :gN groups N row tiles (default 8)
SWEEP = {"forward": ["128x128x64w8s3t", "128x256x64w8s3t", "128x128x64w8s4t", "128x128x64w8s3p",
                     "128x256x64w8s3p", "128x256x64w8s4t", "64x128x64w4s4t"],
         "wgrad": ["128x128x64w8s3t", "64x128x64w4s4t", "128x128x64w8s4t", "128x256x64w8s3t",
                   "128x256x64w8s3t:g16", "64x128x64w4s3t", "64x128x64w4s4p"]}
SWEEP["dgrad"] = SWEEP["forward"]
CUBLAS = "trainfuse cuBLAS matmuls"  # config.library = True: the cuBLAS path


def parse_config(text: str) -> M.MatmulConfig:
    """``"BMxBNxBKwWARPSsSTAGES[t|p][:gGROUP]"`` (e.g. ``128x128x64w8s3t``, ``128x256x64w8s3t:g16``)
    as a MatmulConfig (t: TMA, p: pointers; GROUP row tiles walk the column tiles together)."""
    text, _, group = text.partition(":g")
    tma = not text.endswith("p")
    tiles, rest = text.rstrip("tp").split("w")
    warps, stages = rest.split("s")
    bm, bn, bk = (int(v) for v in tiles.split("x"))
    return M.MatmulConfig(bm, bn, bk, int(warps), int(stages), group_m=int(group or 8), tma=tma)


def _step(mlp, x, cache=True, set_to_none=False):
    params = list(mlp.parameters()) if set_to_none else []

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache):
            mlp(x).float().sum().backward()
    return step


def _sweep(batch, width, rows):
    """Each of the three matmuls alone, per candidate tile shape (bf16 compute, float32 weight as
    under autocast, or bfloat16 as after fuse_casts; activations bf16), with the weight as the
    matmul's B operand (x_first) or its A operand (weight_first)."""
    dev = "cuda"
    bf = torch.bfloat16
    w32 = torch.randn(width, width, device=dev) * width ** -0.5
    w16 = w32.to(bf)
    b = torch.randn(width, device=dev)
    x = torch.randn(batch, width, device=dev, dtype=bf)
    g = torch.randn(batch, width, device=dev, dtype=bf)
    out = torch.empty(batch, width, device=dev, dtype=bf)
    gw, gb = torch.empty_like(w32), torch.empty_like(b)
    flops = 2 * batch * width * width
    ops = {}
    for wname, w in (("w fp32", w32), ("w bf16", w16)):
        ops[("forward", wname)] = lambda w=w: M.linear_forward(x, w, b, out, None, bf, 1, 0, 0.0)
        ops[("dgrad", wname)] = lambda w=w: M.linear_dgrad(g, w, out, bf, 1, x, 0, 0.0)
    ops[("wgrad", "")] = lambda: M.matmul(g.t(), x, gw, bf, M.EPI_WGRAD, db=gb)
    saved = copy.deepcopy(M.config)
    best = {}
    try:
        for (op, wname), fn in ops.items():
            for first in ((False, True) if op != "wgrad" and wname == "w fp32" else (False,)):
                for waves in ((1, 2, 4) if op == "wgrad" else (2,)):
                    for text in SWEEP[op]:
                        setattr(M.config, op, parse_config(text))
                        M.config.weight_first, M.config.wave_programs = first, waves
                        label = " ".join(filter(None, [op, wname, "weight_first" if first else "",
                                                       f"waves={waves}" if op == "wgrad" else ""]))
                        try:
                            ms = graph_ms(fn, repeat=10) / 10
                        except Exception as e:  # noqa: BLE001 - a tile shape may not fit this GPU
                            rows.append([f"B={batch} D={width}", label, text, "ERR",
                                         str(e).splitlines()[0][:50]])
                            continue
                        rows.append([f"B={batch} D={width}", label, text, f"{ms:.4f}",
                                     f"{flops / ms / 1e9:.0f}"])
                        if label not in best or ms < best[label][1]:
                            best[label] = (text, ms)
                    M.config = copy.deepcopy(saved)
    finally:
        M.config = saved
    return best


def workload_label(name: str, set_to_none: bool) -> str:
    """The workload's name in the report: ``"4 x (Linear + relu), B=8192 D=1024, ..."``."""
    w = next(w for w in MLP_WORKLOADS if w.name == name)
    act = w.activation + (f" + dropout {w.dropout}" if w.dropout else "")
    grads = "grads set to None" if set_to_none else "grads accumulate"
    return f"MLP {w.layers} x (Linear + {act}), B={w.batch} D={w.width}, forward + backward, {grads}"


def main(argv=None):
    parser = bench_parser("mlp", __doc__, no_compile=True,
                          only="run only workloads whose name contains this")
    parser.add_argument("--sweep", action="store_true", help="time tile shapes per matmul first")
    parser.add_argument("--set-to-none", action="store_true",
                        help="grads set to None before each step (default: they accumulate)")
    started = parse_and_start(parser, argv, "MLP")
    if started is None:
        return
    args, report, _ = started
    if args.sweep:
        rows, report["sweep"] = [], {}
        for _, batch, width, *_ in MLP_WORKLOADS[:3]:
            report["sweep"][f"B={batch} D={width}"] = _sweep(batch, width, rows)
        print_table("tile sweep, one matmul (bf16, float32 weight)",
                    ["shape", "op", "tiles", "ms", "TFLOP/s"], rows)
        for shape, best in report["sweep"].items():
            print(shape, {op: f"{t} {ms:.4f}" for op, (t, ms) in best.items()})
    rows = []
    for name, batch, width, depth, act, p in MLP_WORKLOADS:
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
        impls["trainfuse grads via autograd"] = FusedMLP.from_sequential(eager, streams=1,
                                                                          fuse_grad_accumulation=False)
        if act == "relu" and not p:  # the chains the cuBLAS path takes
            impls[CUBLAS] = FusedMLP.from_sequential(eager, streams=1)
        if act != "relu":  # the derivative recomputed in the backward instead of kept
            impls["trainfuse recompute"] = FusedMLP.from_sequential(eager, streams=1, recompute=True)
        # bf16 params, as trainfuse.amp.fuse_casts leaves them (float32 masters in the optimizer)
        impls["trainfuse bf16 params"] = FusedMLP.from_sequential(copy.deepcopy(eager).bfloat16())
        res = {}
        for label, mod in impls.items():
            fn = _step(mod, x, set_to_none=args.set_to_none)
            M.config.library = label == CUBLAS
            try:
                fn()
                k, w, h = kernel_ms(fn), wall_ms(fn, iters=50), host_ms(fn, iters=50)
                g = None if label == "torch.compile" else graph_ms(_step(mod, x, cache=False,
                                                                         set_to_none=args.set_to_none))
            except Exception as e:  # noqa: BLE001 - torch.compile may fail on a machine; report it
                rows.append([name, label, "ERR", str(e).splitlines()[0][:60], "", "", "", ""])
                note(report, f"{name} {label}: {rows[-1][3]}")
                continue
            res[label] = {"do_bench_ms": k, "wall_ms": w, "host_ms": h, "graph_ms": g,
                          "tflops": flops / k / 1e9}
            rows.append([name, label, f"{k:.3f}", f"{w:.3f}", "" if g is None else f"{g:.3f}", f"{h:.3f}",
                         f"{flops / k / 1e9:.0f}", ""])
            print("  ".join(rows[-1]), flush=True)  # as it comes: torch.compile can take minutes
        M.config.library = False
        base = res.get("eager", {}).get("do_bench_ms")
        for row in rows[-len(res):]:
            if base and row[1] in res:
                row[7] = f"{base / res[row[1]]['do_bench_ms']:.2f}x eager"
        for label, r in res.items():
            add_row(report, workload_label(name, args.set_to_none), label,
                    trainfuse=label.startswith("trainfuse"), **r)
        for p_ in eager.parameters():
            p_.grad = None
    grads = "grads set to None each step" if args.set_to_none else "grads accumulate"
    print_table(f"MLP forward + backward, bf16 autocast, float32 params, {grads} (do_bench median)",
                ["workload", "implementation", "do_bench ms", "wall ms", "GPU ms (graph)", "host ms",
                 "TFLOP/s", "vs eager"], rows)
    # the README's summary keeps the first shape; the others are in docs/performance.md
    report["summary_skip"] = list(dict.fromkeys(r["workload"] for r in report["rows"]))[1:]
    save_report(report, args.out, "mlp")


if __name__ == "__main__":
    main()
