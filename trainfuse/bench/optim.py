"""Optimizer step benchmark: torch (for-loop, foreach, fused, compiled) against trainfuse.

Workloads (trainfuse.bench.workloads): the GPT-2 124M layout in float32 and bfloat16, a 216-tensor
YOLO-like layout and, when ultralytics is installed, yolov5n's real parameters. Columns: kernel
ms (do_bench median), wall ms (back-to-back steps, host work included), host ms (launch work
alone), % of the copy-bandwidth floor (bytes the update must move over the measured copy rate)
and the speedup over torch's fused step.
"""

from __future__ import annotations

import statistics
import time

import torch

from trainfuse._multi_tensor.tables import config
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
from trainfuse.bench.workloads import gpt2_shapes, yolo_like_shapes, yolov5n
from trainfuse.optim.registry import COUNTERPARTS, Counterpart

# what the README's summary keeps (the rest is in docs/performance.md): every workload of these
# optimizers but the 216-tensor one, and SGD on yolov5n
SUMMARY = {"AdamW": None, "SGD": "yolov5n"}


def label_of(entry: Counterpart) -> str:
    """The optimizer's name in the report: ``"AdamW"``, ``"SGD nesterov"``."""
    nesterov = entry.bench_hparams().get("nesterov")
    return entry.stock_name + (" nesterov" if nesterov else "")


def _states_per_param(entry: Counterpart) -> int:
    """State tensors the fused step reads and writes per param (its bandwidth floor counts them)."""
    p = torch.nn.Parameter(torch.zeros(2, device="cuda"))
    p.grad = torch.ones_like(p)
    opt = entry.fused_class([p], **entry.bench_hparams())
    opt.step()
    return sum(torch.is_tensor(v) and v.shape == p.shape for v in opt.state[p].values() if v is not None)


def _params(shapes, dtype=torch.float32):
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _clone_params(params):
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _groups(entry: Counterpart, ps):
    """The params as the optimizer's users group them: MuSGD's Muon part on the matrices and conv
    filters (ultralytics' layout), SGD on the rest; one group for the others."""
    if entry.stock_name != "MuSGD":
        return ps
    muon = [p for p in ps if p.ndim in (2, 4)]
    return [{"params": muon, "use_muon": True}, {"params": [p for p in ps if p.ndim not in (2, 4)]}]


def _torch_variants(entry: Counterpart):
    return lambda ps, **kw: entry.stock_class(_groups(entry, ps), **entry.bench_hparams(), **kw)


def _ours(entry: Counterpart, ps):
    return entry.fused_class(_groups(entry, ps), **entry.bench_hparams())


def _stock_impls(entry: Counterpart) -> list[tuple[str, dict | None]]:
    """The stock variants timed: torch's three code paths, or the one step of a class without them."""
    if entry.stock_class.__module__.startswith("torch."):
        return [("torch for-loop", dict(foreach=False)), ("torch foreach", dict(foreach=True)),
                ("torch fused", dict(fused=True))]
    return [(f"{entry.stock_class.__module__.split('.')[0]} {entry.stock_name}", {})]


def bench_workload(name, params, entry: Counterpart, bw, compile_torch=True):
    nparam = sum(p.numel() for p in params)
    esize = params[0].element_size()
    # read and write the param and each state, read the grad
    per_param = (3 + 2 * _states_per_param(entry)) * esize
    floor = per_param * nparam / bw * 1e3
    make = _torch_variants(entry)
    results = {}
    impls = _stock_impls(entry)
    if compile_torch and entry is COUNTERPARTS[0]:
        impls.append(("torch compiled", None))
    for label, kw in impls:
        ps = _clone_params(params)
        try:
            if kw is None:
                opt = make(ps, foreach=True)
                step = torch.compile(opt.step)
            else:
                opt = make(ps, **kw)
                step = opt.step
            step()
            step()
            results[label] = (kernel_ms(step), wall_ms(step), host_ms(step), None)
        except Exception as e:  # noqa: BLE001 - a torch variant missing on this version
            print(f"  {label}: skipped ({type(e).__name__}: {str(e)[:80]})")
        del ps
    ps = _clone_params(params)
    opt = _ours(entry, ps)
    opt.step()
    # the GPU's own time too: where the host takes longer than the kernel (small models),
    # do_bench's figure is the host's
    try:
        gpu = graph_ms(opt.step)
    except RuntimeError as e:
        print(f"  trainfuse: no CUDA-graph timing ({str(e).splitlines()[0][:80]})")
        gpu = None
    results["trainfuse"] = (kernel_ms(opt.step), wall_ms(opt.step), host_ms(opt.step), gpu)
    # the fastest stock variant's line: torch's fused, or the class's one step
    fused = results.get("torch fused", results.get(impls[-1][0], (float("nan"),) * 4))
    rows = []
    for label, (k, w, h, g) in results.items():
        gpu = "-" if g is None else f"{g:.4f} ({floor / g * 100:.0f}%)"
        rows.append([label, f"{k:.3f}", f"{w:.3f}", f"{h:.3f}", gpu, f"{floor / k * 100:.0f}%",
                     f"{floor / w * 100:.0f}%", f"{fused[0] / k:.2f}x", f"{fused[1] / w:.2f}x"])
    title = (f"{label_of(entry)} {name}: {nparam / 1e6:.1f}M params in {len(params)} tensors "
             f"({params[0].dtype}), floor {floor:.3f} ms")
    print_table(title, ["impl", "kernel ms", "wall ms", "host ms", "GPU ms, graph (% floor)",
                        "% floor (kernel)", "% floor (wall)", "vs fused (kernel)", "vs fused (wall)"], rows)
    return {"name": name, "kind": label_of(entry), "params": nparam, "tensors": len(params),
            "floor_ms": floor, "results": results}, opt, ps


def workload_label(optimizer: str, name: str, tensors: int, params: int) -> str:
    """The workload's name in the report: ``"AdamW, GPT-2 124M (148 tensors, 124.5M params)"``."""
    return f"{optimizer}, {name} ({tensors} tensors, {params / 1e6:.1f}M params)"


def add_rows(report: dict, res: dict) -> None:
    """One report row per implementation of a :func:`bench_workload` result."""
    label = workload_label(res["kind"], res["name"], res["tensors"], res["params"])
    for impl, (k, w, h, g) in res["results"].items():
        add_row(report, label, impl, trainfuse=impl == "trainfuse", do_bench_ms=k, wall_ms=w, host_ms=h,
                graph_ms=g, floor_ms=res["floor_ms"])


def bench_rebuild(opt, params):
    """Host cost of one step after zero_grad(set_to_none=True): new grad tensors at the same
    addresses (the usual case with the caching allocator) and at new addresses (grad column
    patched), against a step with the grads untouched."""
    grads = [p.grad for p in params]
    spare = [torch.empty_like(g) for g in grads]
    flip = [False]

    def same():
        for p, g in zip(params, grads):
            p.grad = g.view_as(g)  # a new tensor object over the same storage

    def moved():
        flip[0] = not flip[0]
        for p, g, s in zip(params, grads, spare):
            p.grad = s if flip[0] else g

    def timed(prepare):
        times = []
        for _ in range(200):
            prepare()
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        return statistics.median(times)

    res = {"untouched": timed(lambda: None), "same_addresses": timed(same), "moved": timed(moved)}
    rows = [["grads untouched", f"{res['untouched']:.3f}"],
            ["set_to_none, grads back at the same addresses", f"{res['same_addresses']:.3f}"],
            ["set_to_none, grads at new addresses (grad column re-uploaded)", f"{res['moved']:.3f}"]]
    print_table(f"host ms of one step ({len(params)} tensors)", ["case", "host ms"], rows)
    return res


DEFAULT_SWEEP = [(b, u, w) for b, w in ((512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8))
                 for u in (1, 2, 4, 8)]


def sweep_launch(workloads, entries, bw, configs=DEFAULT_SWEEP):
    """Elements per program and warps, over the big and the many-small workload (the defaults in
    trainfuse/_multi_tensor/tables.py come from this table)."""
    keep = (config.block, config.unroll, config.num_warps)
    rows = []
    for block, unroll, warps in configs:
        config.block, config.unroll, config.num_warps = block, unroll, warps
        row = [block, unroll, warps]
        for _, params in workloads:
            for entry in entries:
                nparam = sum(p.numel() for p in params)
                floor = (3 + 2 * _states_per_param(entry)) * params[0].element_size() * nparam / bw * 1e3
                ps = _clone_params(params)
                opt = _ours(entry, ps)
                opt.step()
                ms = kernel_ms(opt.step)
                row.append(f"{ms:.3f} ({floor / ms * 100:.0f}%)")
                del opt, ps
        rows.append(row)
    config.block, config.unroll, config.num_warps = keep
    header = ["block", "unroll", "warps"] + [f"{label_of(e)} {n}" for n, _ in workloads for e in entries]
    print_table("launch sweep: kernel ms (% of floor)", header, rows)
    return rows


def main(argv=None):
    parser = bench_parser("optim", __doc__, no_compile=True,
                          only="run only workloads whose name contains this")
    parser.add_argument("--sweep", action="store_true", help="also sweep block, unroll and warps")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep")
    vectors_too = [c.stock_name for c in COUNTERPARTS if not c.matrices]
    parser.add_argument("--optimizers", default=",".join(vectors_too),
                        help="stock names from trainfuse.optim.registry, comma-separated (default: all but "
                        "Muon, which takes matrices only: python -m trainfuse.bench muon)")
    parser.add_argument("--configs", default="",
                        help="sweep these BLOCKxUNROLLxWARPS configurations, e.g. 512x8x4,512x16x2")
    started = parse_and_start(parser, argv, "optimizer")
    if started is None:
        return
    args, report, bw = started
    wanted = [n for n in args.optimizers.split(",") if n]
    entries = [c for c in COUNTERPARTS if c.stock_name in wanted and c.stock_class is not None]
    unknown = sorted(set(wanted) - set(vectors_too))
    if unknown:
        parser.error(f"--optimizers: {', '.join(unknown)} not among this benchmark's optimizers "
                     f"({', '.join(vectors_too)}; Muon: python -m trainfuse.bench muon)")
    workloads = [("GPT-2 124M", _params(gpt2_shapes())),
                 ("216-tensor YOLO-like", _params(yolo_like_shapes()))]
    bf16 = ("GPT-2 124M bf16", _params(gpt2_shapes(), torch.bfloat16))
    if args.sweep or args.sweep_only:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
        report["sweep"] = sweep_launch(workloads + [bf16], entries, bw, configs or DEFAULT_SWEEP)
        if args.sweep_only:
            return
    y5 = yolov5n()
    if y5 is not None:
        workloads.append(("yolov5n", _clone_params([p for p in y5.parameters() if p.requires_grad])))
    else:
        note(report, "ultralytics not installed: yolov5n row skipped")
    workloads.append(bf16)
    for name, params in workloads:
        if args.only.lower() not in name.lower():
            continue
        for entry in entries:
            res, opt, ps = bench_workload(name, params, entry, bw, compile_torch=not args.no_compile)
            add_rows(report, res)
            only = SUMMARY.get(entry.stock_name, "")
            if name.startswith("216") or entry.stock_name not in SUMMARY or (only and name != only):
                report.setdefault("summary_skip", []).append(
                    workload_label(res["kind"], name, res["tensors"], res["params"]))
            if name.startswith("216") and entry is COUNTERPARTS[0]:
                report["rebuild"] = bench_rebuild(opt, ps)
            del opt, ps
    save_report(report, args.out, "optim")


__all__ = ["main"]
