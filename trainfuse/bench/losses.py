"""Loss benchmark: CIoU loss and BCE-with-logits, forward + backward, eager torch, torch.compile
and trainfuse, with the bandwidth floor. Box counts and shapes from trainfuse.bench.workloads.

``do_bench ms`` is triton's do_bench (an L2 flush, then the call; host work longer than the
flush shows up in it). ``wall ms`` is back-to-back calls. ``CUDA-graph
replay`` is the same forward + backward captured once and replayed: the GPU's own time, without
Python and autograd on the host. At 8,400 boxes the host dominates every variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    graph_ms,
    kernel_ms,
    note,
    parse_and_start,
    print_table,
    save_report,
    wall_ms,
)
from trainfuse.bench.workloads import BCE_SHAPES, CIOU_SIZES
from trainfuse.losses import bce_with_logits, iou_loss
from trainfuse.losses.iou import bbox_iou_reference


def _ciou_eager(b1, b2):
    return (1 - bbox_iou_reference(b1, b2, xywh=False, CIoU=True)).sum()


def _fwd_bwd(loss_fn, x, *args):
    def step():
        x.grad = None  # as after zero_grad(set_to_none=True): no accumulation kernel
        loss_fn(x, *args).backward()

    def captured():
        # the same kernels for the CUDA graph, with the grad returned instead of stored in the
        # leaf: torch 2.11 refuses to capture a backward that sets the .grad of a leaf made on
        # the default stream ("would make the legacy stream depend on a capturing stream")
        return torch.autograd.grad(loss_fn(x, *args), x)

    step.captured = captured
    return step


def _row(name, fn, floor, graph=True):
    try:
        fn()
        k, w = kernel_ms(fn), wall_ms(fn, iters=50)
        g = graph_ms(fn.captured) if graph else None
    except Exception as e:  # noqa: BLE001 - torch.compile may fail on a machine; report it
        return [name, "ERR", str(e).splitlines()[0][:60], "", "", ""], None
    gs = "" if g is None else f"{g:.4f} ({floor / g * 100:.0f}%)"
    return [name, f"{k:.4f}", f"{w:.4f}", gs, "", ""], (k, w, g)


def _compare(report, label, workload, impls, floor, rows):
    """One table row per implementation (appended to ``rows``, named ``label``) and one report row
    per implementation that ran (under ``workload``), trainfuse last; returns the timings by name."""
    res = {}
    for name, fn in impls.items():
        row, res[name] = _row(f"{label} {name}", fn, floor, graph=name != "torch.compile")
        rows.append(row)
        if res[name] is None:
            note(report, f"{label} {name}: {row[2]}")
        else:
            k, w, g = res[name]
            add_row(report, workload, name, trainfuse=name == "trainfuse",
                    do_bench_ms=k, wall_ms=w, graph_ms=g, floor_ms=floor)
    ours = res["trainfuse"][0]
    for row, name in zip(rows[-len(impls):], impls):
        if res[name] is not None and name != "trainfuse":
            row[4] = f"trainfuse {res[name][0] / ours:.1f}x faster"
    return res


def _ciou(report, bw, sizes, with_compile):
    rows = []
    compiled = torch.compile(_ciou_eager) if with_compile else None
    for n in sizes:
        xy = torch.rand(n, 2, device="cuda") * 600
        wh = torch.rand(n, 2, device="cuda") * 100 + 1
        b1 = torch.cat([xy, xy + wh], 1).requires_grad_()
        b2 = torch.cat([xy + 5, xy + wh * 0.9], 1)
        floor = n * 16 * 3 / bw * 1e3  # read both boxes, write the grad
        impls = {"eager": _fwd_bwd(_ciou_eager, b1, b2)}
        if compiled is not None:
            impls["torch.compile"] = _fwd_bwd(compiled, b1, b2)
        impls["trainfuse"] = _fwd_bwd(lambda a, b: iou_loss(a, b, kind="ciou", reduction="sum"), b1, b2)
        _compare(report, f"CIoU n={n:,}", f"CIoU loss sum, {n:,} boxes, forward + backward", impls, floor,
                 rows)
    return rows


def _bce(report, bw, shapes, with_compile):
    rows = []
    compiled = torch.compile(F.binary_cross_entropy_with_logits) if with_compile else None
    for shape, dtype in shapes:
        x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
        y = (torch.rand(shape, device="cuda") > 0.9).to(dtype)
        floor = x.numel() * x.element_size() * 3 / bw * 1e3  # read x and y, write the grad
        impls = {"eager": _fwd_bwd(F.binary_cross_entropy_with_logits, x, y)}
        if compiled is not None:
            impls["torch.compile"] = _fwd_bwd(compiled, x, y)
        impls["trainfuse"] = _fwd_bwd(bce_with_logits, x, y)
        label = f"BCE {tuple(shape)} {str(dtype).removeprefix('torch.')}"
        _compare(report, label, f"BCE-with-logits mean, {label[4:]}, forward + backward", impls, floor, rows)
        del x, y
    return rows


def main(argv=None):
    parser = bench_parser("losses", __doc__, no_compile=True)
    parser.add_argument("--sizes", default=",".join(map(str, CIOU_SIZES)), help="CIoU box counts")
    started = parse_and_start(parser, argv, "loss")
    if started is None:
        return
    args, report, bw = started
    header = ["forward + backward", "do_bench ms", "wall ms", "CUDA-graph replay ms (% floor)",
              "vs trainfuse (do_bench)", ""]
    rows = _ciou(report, bw, [int(s) for s in args.sizes.split(",")], not args.no_compile)
    print_table("CIoU loss sum(1 - CIoU), xyxy, float32 (floor: read both boxes, write the grad)",
                header, rows)
    rows = _bce(report, bw, BCE_SHAPES, not args.no_compile)
    print_table("BCE-with-logits, mean (floor: read logits and targets, write the grad)", header, rows)
    # the README's summary keeps one CIoU and one BCE workload; the others are in docs/performance.md
    keep = ("CIoU loss sum, 8,400 boxes", "BCE-with-logits mean, (64, 8400, 80) bfloat16")
    report["summary_skip"] = [w for w in dict.fromkeys(r["workload"] for r in report["rows"])
                              if not w.startswith(keep)]
    save_report(report, args.out, "losses")


__all__ = ["main"]
