"""Stem benchmark: a detector's first convolution (3 input channels, stride 2), forward and weight
grad, torch's ``conv2d`` against the same function folded onto the space-to-depth image
(:mod:`trainfuse.nn.stem`), at batch 16 and 640 px under float16 autocast in channels_last, as
ultralytics trains. Two stems: YOLOv5's 6 x 6 (padding 2), which ``FusedDetectionTrainer`` folds,
and YOLO11/YOLO26's 3 x 3 (padding 1), which it leaves alone (its fold is slower). GPU time of a
call (forward, a sum, backward): the median of ``triton.testing.do_bench``.

Then the same stems from the uint8 batch: ultralytics' preprocessing (``float() / 255``) and the
convolution as the trainer runs it by default, against the convolution taking the uint8 batch
(``raw_images=True``: :mod:`trainfuse.nn.image_input`, folded as it is read for the 6 x 6 stem)."""

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
from trainfuse.nn import image_input, stem

STEMS = {"YOLOv5 stem 6x6 s2 p2": (6, 2), "YOLO11/26 stem 3x3 s2 p1": (3, 1)}


def _step(conv: nn.Conv2d, x: torch.Tensor):
    def run() -> None:
        with torch.autocast("cuda", torch.float16):
            y = conv(x)
        y.float().sum().backward()
    return run


def _from_images(conv: nn.Conv2d, images: torch.Tensor, raw: bool):
    def run() -> None:
        x = images if raw else images.float() / 255  # ultralytics' preprocess_batch
        with torch.autocast("cuda", torch.float16):
            y = conv(x)
        y.float().sum().backward()
    return run


def main(argv: list[str] | None = None) -> dict | None:
    parser = bench_parser("stem", __doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    started = parse_and_start(parser, argv, "stem")
    if started is None:
        return None
    args, report, _ = started
    report["headline"] = "do_bench_ms"  # GPU time of one convolution: no host work to count
    x = torch.rand(args.batch, 3, args.imgsz, args.imgsz, device="cuda")
    rows = []
    for name, (k, p) in STEMS.items():
        workload = f"{name}, batch {args.batch}, {args.imgsz} px, fp16 channels_last: forward + weight grad"
        times = {}
        for folded in (False, True):
            torch.manual_seed(0)
            conv = nn.Conv2d(3, 16, k, 2, p, bias=False).cuda().to(memory_format=torch.channels_last)
            if folded:  # forced for the 3 x 3 stem too, which the trainer would leave alone
                conv.forward = lambda t, c=conv, pad=p: stem.folded_conv2d(t, c.weight, c.bias, pad)
            times[folded] = kernel_ms(_step(conv, x))
        add_row(report, workload, "torch conv2d", trainfuse=False, do_bench_ms=times[False])
        add_row(report, workload, "space-to-depth fold", trainfuse=True, do_bench_ms=times[True])
        rows.append([name, f"{times[False]:.3f}", f"{times[True]:.3f}", f"{times[False] / times[True]:.2f}x",
                     "folded" if stem.foldable(nn.Conv2d(3, 16, k, 2, p)) else "left alone"])
    print_table("stem convolution, GPU ms per call", ["stem", "torch", "folded", "speedup", "trainer"], rows)
    images = torch.randint(0, 256, (args.batch, 3, args.imgsz, args.imgsz), dtype=torch.uint8, device="cuda")
    rows = []
    for name, (k, p) in STEMS.items():
        workload = (f"{name}, batch {args.batch}, {args.imgsz} px, from the uint8 batch: preprocessing, "
                    "forward + weight grad")
        times = {}
        for raw in (False, True):
            torch.manual_seed(0)
            conv = nn.Conv2d(3, 16, k, 2, p, bias=False).cuda().to(memory_format=torch.channels_last)
            stem.install(conv)  # as the trainer runs it (the 3 x 3 stem is left alone)
            if raw and not stem.installed(conv):
                image_input.install(conv)
            times[raw] = kernel_ms(_from_images(conv, images, raw))
        add_row(report, workload, "float() / 255, then the convolution", trainfuse=False,
                do_bench_ms=times[False])
        add_row(report, workload, "the convolution on the uint8 batch", trainfuse=True,
                do_bench_ms=times[True])
        rows.append([name, f"{times[False]:.3f}", f"{times[True]:.3f}", f"{times[False] / times[True]:.2f}x"])
    print_table("from the uint8 batch, GPU ms per call", ["stem", "float() / 255", "uint8 input", "speedup"],
                rows)
    # a part of the YOLO iteration, which the README's table shows whole; docs/performance.md
    # shows these rows
    report["summary_skip"] = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    save_report(report, args.out, "stem")
    return report


__all__ = ["main"]
