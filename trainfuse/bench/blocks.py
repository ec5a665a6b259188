"""Conv-block benchmark: a YOLO layer's BatchNorm2d and SiLU in training, forward and backward, as
torch runs them (``nn.BatchNorm2d`` then ``nn.SiLU``: cuDNN's BatchNorm, an elementwise SiLU)
against :func:`trainfuse.nn.bn_silu.batch_norm_silu`, on the activation sizes of YOLO11m's and
YOLOv5n's stages at batch 16 and 640 px, float16, contiguous and channels_last. GPU time of a call
(forward, backward from a fixed ``dy``) replayed from a CUDA graph, and the median of
``triton.testing.do_bench`` over the eager call (host work included); the floor is the fused op's
bytes (forward 2 reads and a write, backward 4 reads and a write of the activation) over the
measured copy bandwidth. Each fused call is also profiled by kernel (statistics, apply,
grad sums, dx: GPU µs of each, and its share of its own floor: the statistics read the activation
once, apply and the grad sums move it twice, dx three times; with ``TRAINFUSE_BN_PERSIST=1`` the
one-launch forward and backward instead, three and five times), which shows what a small layer pays
beside its bytes (the launch, the reductions' last program adding up the partials). Then a C2f
bottleneck's tail on the same sizes in channels_last: BatchNorm, SiLU and the shortcut's add
concatenated after another branch, its output read by the next bottleneck too, as torch's ops and
``torch.cat`` run it against :func:`trainfuse.nn.bn_silu_into.batch_norm_silu_into` writing into
the concatenation's buffer. Then SPPF's three poolings and their concatenation on yolo11m's and
yolov5n's map sizes: torch's ``max_pool2d`` and ``cat`` against
:func:`trainfuse.nn.pool_chain.max_pool_chain`; and a neck's 2x upsampling with the concatenation
after it on yolo11m's sizes: ``interpolate`` and ``cat`` against
:func:`trainfuse.nn.upsample_concat.upsample_concat`.

Then whole models (``--models``, default YOLO11m; ``none`` skips them): an ultralytics detection
model's forward and backward in training mode under float16 autocast, at batch 16 and 640 px, as
torch runs it (contiguous, ultralytics' layout), in channels_last, with the blocks fused as the
trainer's ``fuse_blocks=True`` fuses them (every ``Conv`` block's BatchNorm and SiLU as one op,
SPPF's poolings, the neck's upsamplings in 16 bits and joined to their concatenations), both, and
both with the C2f and C3 blocks' concatenations written in
place (``TRAINFUSE_FUSE_CONCAT=1`` in the trainer), and channels_last stock and fused with cuDNN's
convolution algorithms chosen by timing them (``torch.backends.cudnn.benchmark``, the trainer's
``cudnn_benchmark=True``): which route pays before the training loop is changed (the GPU time of
the step replayed from a CUDA graph, and do_bench's time of the eager call). With ``--compile`` an
eighth variant, ``torch.compile(model)`` in channels_last (inductor's own
kernels, default mode: no CUDA graphs of its own), and the seconds its first call took to compile.
``python -m trainfuse.bench yolo --model yolo11m.yaml --fuse-blocks`` times the op in the loop."""

from __future__ import annotations

import time

import torch
from torch import nn

from trainfuse.bench._common import (
    add_row,
    bench_parser,
    graph_ms,
    kernel_ms,
    parse_and_start,
    print_table,
    save_report,
)
from trainfuse.nn.bn_silu import batch_norm_silu
from trainfuse.nn.bn_silu_into import batch_norm_silu_into
from trainfuse.nn.concat import ConcatBuffer
from trainfuse.nn.pool_chain import max_pool_chain, max_pool_chain_torch
from trainfuse.nn.upsample_concat import upsample_concat, upsample_concat_torch

# (channels, side): YOLO11m's stages at 640 px (64 at 320 to 512 at 20) and YOLOv5n's first
LAYERS = [(64, 320), (128, 160), (256, 80), (512, 40), (512, 20), (16, 320)]
ACCESSES = 8  # activation reads and writes of the fused forward (3) and backward (5)
# the fused op's kernels and the activation reads and writes of each; with TRAINFUSE_BN_PERSIST=1
# the one-launch forward and backward (trainfuse.nn.bn_persist) take the place of the first two and
# the last two (their second read from cache where the map fits)
KERNELS = {"bn_stats_kernel": 1, "bn_silu_apply_kernel": 2, "bn_silu_grad_sums_kernel": 2,
           "bn_silu_dx_kernel": 3, "bn_stats_apply_kernel": 3, "bn_grad_dx_kernel": 5}


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


def _concat_steps(bn: nn.BatchNorm2d, x: torch.Tensor, r: torch.Tensor, other: torch.Tensor,
                  dout: torch.Tensor, g: torch.Tensor):
    """A C2f bottleneck's tail, forward and backward: ``y = r + silu(bn(x))`` concatenated after
    ``other``, ``y`` read by the next bottleneck too (its grad ``g``): torch's ops and ``cat``,
    and :func:`~trainfuse.nn.bn_silu_into.batch_norm_silu_into` into a ``ConcatBuffer``."""
    act = nn.SiLU()

    def stock() -> None:
        y = r + act(bn(x))
        out = torch.cat([other, y], 1)
        torch.autograd.backward([out, y], [dout, g])

    def ours() -> None:
        buffer = ConcatBuffer(other.shape[1] + x.shape[1])
        first = buffer.write(other)
        piece, y = batch_norm_silu_into(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.03,
                                        1e-3, buffer, 0, residual=r)
        torch.autograd.backward([buffer.join(first, piece), y], [dout, g])
    return stock, ours


def _concat_layers(report: dict, batch: int) -> None:
    """:func:`_concat_steps` on the channels_last layer sizes."""
    rows = []
    for channels, side in LAYERS:
        def make(c: int, side: int = side) -> torch.Tensor:
            t = torch.randn(batch, c, side, side, device="cuda", dtype=torch.float16)
            return t.contiguous(memory_format=torch.channels_last)
        x, r, other = make(channels).requires_grad_(), make(channels).requires_grad_(), make(channels)
        dout, g = make(2 * channels), make(channels)
        bn = nn.BatchNorm2d(channels, eps=1e-3, momentum=0.03).cuda()
        stock, ours = _concat_steps(bn, x, r, other, dout, g)
        shape = f"({batch}, {channels}, {side}, {side})"
        workload = ("BatchNorm2d + SiLU + shortcut into a concatenation, training, forward + backward: "
                    f"{shape} float16 channels_last")
        times = {"torch": graph_ms(stock), "ours": graph_ms(ours)}
        add_row(report, workload, "torch (cuDNN BatchNorm, SiLU, add, cat)", trainfuse=False,
                graph_ms=times["torch"], do_bench_ms=kernel_ms(stock))
        add_row(report, workload, "batch_norm_silu_into", trainfuse=True, graph_ms=times["ours"],
                do_bench_ms=kernel_ms(ours))
        speedup = times["torch"] / times["ours"]
        rows.append([shape, f"{times['torch']:.3f}", f"{times['ours']:.3f}", f"{speedup:.2f}x"])
    print_table("a bottleneck's BatchNorm, SiLU and shortcut into a C2f concatenation, GPU ms per call "
                "replayed from a CUDA graph",
                ["activation", "torch + cat", "into the buffer", "speedup"], rows)


SPPF_MAPS = [(256, 20), (128, 20)]  # yolo11m's and yolov5n's SPPF maps at 640 px: (channels, side)


def _pool_layers(report: dict, batch: int) -> None:
    """SPPF's three 5 x 5 poolings and their concatenation, forward and backward, on its map sizes in
    channels_last: torch's ``max_pool2d`` and ``cat`` against :func:`~trainfuse.nn.pool_chain.
    max_pool_chain`."""
    rows = []
    for channels, side in SPPF_MAPS:
        y = torch.randn(batch, channels, side, side, device="cuda", dtype=torch.float16)
        y = y.contiguous(memory_format=torch.channels_last).requires_grad_()
        g = torch.randn(batch, 4 * channels, side, side, device="cuda", dtype=torch.float16)
        g = g.contiguous(memory_format=torch.channels_last)

        def step(fn, y=y, g=g):
            return lambda: fn(y, 5, 3).backward(g)

        stock, ours = step(max_pool_chain_torch), step(max_pool_chain)
        shape = f"({batch}, {channels}, {side}, {side})"
        workload = (f"SPPF poolings (3 x 5x5) + concatenation, forward + backward: {shape} float16 "
                    "channels_last")
        times = {"torch": graph_ms(stock), "ours": graph_ms(ours)}
        add_row(report, workload, "torch (max_pool2d x 3, cat)", trainfuse=False, graph_ms=times["torch"],
                do_bench_ms=kernel_ms(stock))
        add_row(report, workload, "max_pool_chain", trainfuse=True, graph_ms=times["ours"],
                do_bench_ms=kernel_ms(ours))
        rows.append([shape, f"{times['torch']:.3f}", f"{times['ours']:.3f}",
                     f"{times['torch'] / times['ours']:.2f}x"])
    print_table("SPPF's poolings and concatenation, GPU ms per call replayed from a CUDA graph",
                ["map", "torch", "max_pool_chain", "speedup"], rows)


NECK_JOINS = [(512, 512, 20), (512, 256, 40)]  # yolo11m's at 640 px: (upsampled, other, side before)


def _neck_joins(report: dict, batch: int) -> None:
    """A neck's 2x nearest upsampling and the concatenation after it, forward and backward, in
    float16 channels_last on yolo11m's sizes: torch's ``interpolate`` and ``cat`` against
    :func:`~trainfuse.nn.upsample_concat.upsample_concat`."""
    rows = []
    for ca, cb, side in NECK_JOINS:
        def make(c: int, s: int) -> torch.Tensor:
            t = torch.randn(batch, c, s, s, device="cuda", dtype=torch.float16)
            return t.contiguous(memory_format=torch.channels_last)

        a, b = make(ca, side).requires_grad_(), make(cb, 2 * side).requires_grad_()
        g = make(ca + cb, 2 * side)

        def step(fn, a=a, b=b, g=g):
            return lambda: fn(a, b).backward(g)

        stock, ours = step(upsample_concat_torch), step(upsample_concat)
        shape = f"({batch}, {ca}, {side}, {side}) up + ({batch}, {cb}, {2 * side}, {2 * side})"
        workload = (f"neck upsampling (2x nearest) + concatenation, forward + backward: {shape} float16 "
                    "channels_last")
        times = {"torch": graph_ms(stock), "ours": graph_ms(ours)}
        add_row(report, workload, "torch (interpolate, cat)", trainfuse=False, graph_ms=times["torch"],
                do_bench_ms=kernel_ms(stock))
        add_row(report, workload, "upsample_concat", trainfuse=True, graph_ms=times["ours"],
                do_bench_ms=kernel_ms(ours))
        rows.append([shape, f"{times['torch']:.3f}", f"{times['ours']:.3f}",
                     f"{times['torch'] / times['ours']:.2f}x"])
    print_table("a neck's upsampling and concatenation, GPU ms per call replayed from a CUDA graph",
                ["maps", "torch", "upsample_concat", "speedup"], rows)


def _kernel_us(run, calls: int = 5) -> dict[str, float]:
    """GPU µs per call of each of :data:`KERNELS` in ``run``, from the profiler."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    us = dict.fromkeys(KERNELS, 0.0)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = next((k for k in KERNELS if event.name.startswith(k)), None)
            if name is not None:
                us[name] += event.device_time / calls
    return us


def _model_step(model: nn.Module, x: torch.Tensor):
    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.float16):
            out = model(x)
        parts = [v for v in out.values() if torch.is_tensor(v)] if isinstance(out, dict) else list(out)
        sum(p.float().mean() for p in parts).backward()
    return run


CONCAT = "fused blocks, concatenations in place, channels_last"
TIMED = ", cudnn.benchmark"  # cuDNN's algorithms chosen by timing them (the trainer's cudnn_benchmark)
VARIANTS = ("contiguous", "channels_last", "fused blocks", "fused blocks, channels_last", CONCAT,
            "channels_last" + TIMED, "fused blocks, channels_last" + TIMED)
COMPILED = "torch.compile, channels_last"


def _models(report: dict, names: list[str], batch: int, compile_too: bool = False) -> None:
    """Each model's training forward + backward in its seven variants, and compiled with
    ``compile_too`` (module docstring)."""
    from ultralytics.nn.tasks import DetectionModel

    from trainfuse.ultralytics.changes import upsample as upsamplings
    from trainfuse.ultralytics.changes.blocks import fuse_model

    rows = []
    for name in names:
        workload = f"{name} forward + backward, training, float16 autocast, batch {batch}, 640 px"
        times = {}
        for variant in VARIANTS + ((COMPILED,) if compile_too else ()):
            torch.manual_seed(0)
            model = DetectionModel(name, nc=80, verbose=False).cuda().train()
            x = torch.rand(batch, 3, 640, 640, device="cuda")
            if "channels_last" in variant:
                model = model.to(memory_format=torch.channels_last)
                x = x.contiguous(memory_format=torch.channels_last)
            if "fused" in variant:  # as the trainer's fuse_blocks=True: C2f's halves dense too, or
                fuse_model(model, concat=variant == CONCAT)  # the CSP blocks' concatenations in place
                upsamplings.install(model)  # the neck's upsamplings in 16 bits, joined to their Concats
            torch.backends.cudnn.benchmark = variant.endswith(TIMED)  # timed in graph_ms's warm-up
            if variant == COMPILED:
                model = torch.compile(model)
                start = time.perf_counter()
                _model_step(model, x)()  # the first call compiles the forward and the backward
                torch.cuda.synchronize()
                report.setdefault("compile_s", {})[name] = seconds = time.perf_counter() - start
                print(f"{name}: torch.compile's first call took {seconds:.1f} s")
            # the step replayed from a CUDA graph, as the trainer runs it (an eager step with the
            # fused blocks is host-bound: four launches and an autograd Function a block)
            times[variant] = graph_ms(_model_step(model, x))
            add_row(report, workload, variant if "fused" not in variant else f"trainfuse {variant}",
                    trainfuse="fused" in variant, graph_ms=times[variant],
                    do_bench_ms=kernel_ms(_model_step(model, x), warmup=100, rep=500))  # ms: ~20 calls
            if variant == COMPILED:
                torch.compiler.reset()
            torch.backends.cudnn.benchmark = False
            del model, x
            torch.cuda.empty_cache()
        base = times["contiguous"]
        rows += [[name, v, f"{t:.2f}", f"{base / t:.2f}x"] for v, t in times.items()]
    print_table("model forward + backward, GPU ms per step replayed from a CUDA graph",
                ["model", "variant", "ms", "vs contiguous"],
                rows)


def main(argv: list[str] | None = None) -> dict | None:
    parser = bench_parser("blocks", __doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--models", default="yolo11m.yaml",
                        help="comma list of detection models to time whole (needs ultralytics), or none")
    parser.add_argument("--compile", action="store_true",
                        help="also time each model under torch.compile (minutes of compiling a model)")
    started = parse_and_start(parser, argv, "blocks")
    if started is None:
        return None
    args, report, bandwidth = started
    report["headline"] = "graph_ms"
    rows, kernel_rows = [], []
    for channels, side in LAYERS:
        for layout in ("contiguous", "channels_last"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            x = torch.randn(args.batch, channels, side, side, device="cuda", dtype=torch.float16)
            x = x.contiguous(memory_format=fmt).requires_grad_()
            dy = torch.randn_like(x)
            bn = nn.BatchNorm2d(channels, eps=1e-3, momentum=0.03).cuda()
            # the GPU's time from graph replays (an eager call of the fused op is host-bound on the
            # smaller layers), and do_bench's, host work included
            times = {"torch": graph_ms(_torch_step(bn, x, dy)), "fused": graph_ms(_fused_step(bn, x, dy))}
            floor = ACCESSES * x.numel() * x.element_size() / bandwidth * 1e3
            shape = f"({args.batch}, {channels}, {side}, {side})"
            workload = f"BatchNorm2d + SiLU, training, forward + backward: {shape} float16 {layout}"
            add_row(report, workload, "torch (cuDNN BatchNorm, SiLU)", trainfuse=False,
                    graph_ms=times["torch"], do_bench_ms=kernel_ms(_torch_step(bn, x, dy)))
            add_row(report, workload, "batch_norm_silu", trainfuse=True, graph_ms=times["fused"],
                    do_bench_ms=kernel_ms(_fused_step(bn, x, dy)), floor_ms=floor)
            rows.append([shape, layout, f"{times['torch']:.3f}", f"{times['fused']:.3f}",
                         f"{times['torch'] / times['fused']:.2f}x", f"{floor / times['fused']:.0%}"])
            us = _kernel_us(_fused_step(bn, x, dy))
            one = x.numel() * x.element_size() / bandwidth * 1e6  # µs to move the activation once
            report.setdefault("kernels_us", {})[workload] = us
            kernel_rows.append([shape, layout, *(f"{t:.1f} ({one * n / t:.0%})" if t else "-"
                                                  for t, n in zip(us.values(), KERNELS.values()))])
    print_table("BatchNorm2d + SiLU forward + backward, GPU ms per call replayed from a CUDA graph",
                ["activation", "layout", "torch", "fused", "speedup", "fused % of floor"], rows)
    print_table("the fused op's kernels, GPU µs per call (% of each kernel's floor)",
                ["activation", "layout", "statistics", "apply", "grad sums", "dx", "one-launch forward",
                 "one-launch backward"], kernel_rows)
    _concat_layers(report, args.batch)
    _pool_layers(report, args.batch)
    _neck_joins(report, args.batch)
    if args.models != "none":
        _models(report, [m for m in args.models.split(",") if m], args.batch, args.compile)
    report["summary_skip"] = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    save_report(report, args.out, "blocks")
    return report


__all__ = ["main"]
