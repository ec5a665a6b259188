"""Muon benchmark: one optimizer step over GPT-2 124M's hidden matrices (the 48 attention and MLP
weights of its 12 layers, 85M params; embeddings and norms go to AdamW, as Muon's users pair them),
``torch.optim.Muon`` (one matrix at a time) against :class:`trainfuse.optim.muon.FusedMuon`
(Newton-Schulz in a few padded bfloat16 batches, the rest in one launch), float32 params, Muon's
defaults with ``lr=0.02``. Wall time of back-to-back steps (host work included) and GPU time."""

from __future__ import annotations

import torch

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    kernel_ms,
    parse_and_start,
    print_table,
    save_report,
    wall_ms,
)
from trainfuse.bench.workloads import gpt2_shapes
from trainfuse.optim.muon import FusedMuon


def _matrices() -> list[torch.nn.Parameter]:
    """GPT-2 124M's hidden matrices (not its embeddings), on the GPU, with fixed grads."""
    g = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for shape in gpt2_shapes()[2:]:
        if len(shape) == 2:
            p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=g) * 0.02)
            p.grad = torch.randn(shape, device="cuda", generator=g) * 1e-3
            params.append(p)
    return params


def main(argv: list[str] | None = None) -> dict | None:
    parser = bench_parser("muon", __doc__)
    started = parse_and_start(parser, argv, "muon")
    if started is None:
        return None
    args, report, _ = started
    if not hasattr(torch.optim, "Muon"):
        report["notes"] = ["torch.optim.Muon needs torch 2.9 or later: nothing measured"]
        save_report(report, args.out, "muon")
        return report
    report["headline"] = "wall_ms"
    workload = "Muon step, GPT-2 124M hidden matrices (48 tensors, 85M params), float32"
    times = {}
    for name, cls in (("torch.optim.Muon", torch.optim.Muon), ("FusedMuon", FusedMuon)):
        opt = cls(_matrices(), lr=0.02)
        times[name] = (wall_ms(opt.step, iters=20, repeats=3), kernel_ms(opt.step))
        add_row(report, workload, name, trainfuse=name == "FusedMuon", wall_ms=times[name][0],
                do_bench_ms=times[name][1])
    base = times["torch.optim.Muon"]
    print_table(workload, ["optimizer", "wall ms", "GPU ms", "wall speedup"],
                [[n, f"{w:.2f}", f"{k:.2f}", f"{base[0] / w:.2f}x"] for n, (w, k) in times.items()])
    save_report(report, args.out, "muon")
    return report


__all__ = ["main"]
