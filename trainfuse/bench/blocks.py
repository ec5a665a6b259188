"""Conv-block benchmark: a YOLO layer's BatchNorm2d and SiLU in training, forward and backward, as
torch runs them (``nn.BatchNorm2d`` then ``nn.SiLU``: cuDNN's BatchNorm, an elementwise SiLU)
against :func:`trainfuse.nn.bn_silu.batch_norm_silu`, on the activation sizes of YOLO11m's and
YOLOv5n's stages at batch 16 and 640 px, float16, contiguous and channels_last. GPU time of a call
(forward, backward from a fixed ``dy``): the median of ``triton.testing.do_bench``; the floor is
the fused op's bytes (forward 2 reads and a write, backward 4 reads and a write of the activation)
over the measured copy bandwidth. Measures the op alone: ``python -m trainfuse.bench yolo --model
yolo11m.yaml --fuse-blocks`` times it in the training loop."""

from __future__ import annotations

import torch
from torch import nn

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    kernel_ms,
    parse_and_start,
    print_table,
    save_report,
)
from trainfuse.nn.bn_silu import batch_norm_silu

# (channels, side): YOLO11m's stages at 640 px (64 at 320 to 512 at 20) and YOLOv5n's first
LAYERS = [(64, 320), (128, 160), (256, 80), (512, 40), (512, 20), (16, 320)]
ACCESSES = 8  # activation reads and writes of the fused forward (3) and backward (5)


def _torch_step(bn: nn.BatchNorm2d, x: torch.Tensor, dy: torch.Tensor):
    act = nn.SiLU()

    def run() -> None:
        y = act(bn(x))
        y.backward(dy)
    return run


def _fused_step(bn: nn.BatchNorm2d, x: torch.Tensor, dy: torch.Tensor):
    def run() -> None:
        y = batch_norm_silu(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.03, 1e-3)
        y.backward(dy)
    return run


def main(argv: list[str] | None = None) -> dict | None:
    parser = bench_parser("blocks", __doc__)
    parser.add_argument("--batch", type=int, default=16)
    started = parse_and_start(parser, argv, "blocks")
    if started is None:
        return None
    args, report, bandwidth = started
    report["headline"] = "do_bench_ms"
    rows = []
    for channels, side in LAYERS:
        for layout in ("contiguous", "channels_last"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            x = torch.randn(args.batch, channels, side, side, device="cuda", dtype=torch.float16)
            x = x.contiguous(memory_format=fmt).requires_grad_()
            dy = torch.randn_like(x)
            bn = nn.BatchNorm2d(channels, eps=1e-3, momentum=0.03).cuda()
            times = {"torch": kernel_ms(_torch_step(bn, x, dy)), "fused": kernel_ms(_fused_step(bn, x, dy))}
            floor = ACCESSES * x.numel() * x.element_size() / bandwidth * 1e3
            shape = f"({args.batch}, {channels}, {side}, {side})"
            workload = f"BatchNorm2d + SiLU, training, forward + backward: {shape} float16 {layout}"
            add_row(report, workload, "torch (cuDNN BatchNorm, SiLU)", trainfuse=False,
                    do_bench_ms=times["torch"])
            add_row(report, workload, "batch_norm_silu", trainfuse=True, do_bench_ms=times["fused"],
                    floor_ms=floor)
            rows.append([shape, layout, f"{times['torch']:.3f}", f"{times['fused']:.3f}",
                         f"{times['torch'] / times['fused']:.2f}x", f"{floor / times['fused']:.0%}"])
    print_table("BatchNorm2d + SiLU forward + backward, GPU ms per call",
                ["activation", "layout", "torch", "fused", "speedup", "fused % of floor"], rows)
    report["summary_skip"] = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    save_report(report, args.out, "blocks")
    return report


__all__ = ["main"]
