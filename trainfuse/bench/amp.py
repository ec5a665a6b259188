"""Mixed-precision step benchmark: cast fusion, fused clipping, ultralytics' optimizer phase.

Rows, each beside what torch users run today, in one run:

- GPT-2 124M bf16: torch fused AdamW on float32 params + the bf16 weight casts autocast does in
  the next forward, against FusedAdamW with float32 masters writing the bf16 weights (fuse_casts).
- a 6-layer d=768 GPT-like model, forward + backward + step: autocast + torch fused AdamW against
  fuse_casts + FusedAdamW, per-step time and the loss after N steps of a fixed synthetic task.
- clip_grad_norm_ on GPT-2 and yolov5n: torch's against trainfuse.amp.clip_grad_norm_.
- AdamW with clipping by value on GPT-2 and yolov5n: clip_grad_value_ + torch's fused AdamW
  against FusedAdamW(max_grad_value=...), where the update clamps the grads itself.
- yolov5n's optimizer phase (unscale_, clip_grad_norm_(10), scaler.step(SGD nesterov),
  scaler.update, ModelEMA.update) against trainfuse's GradScaler + FusedSGD(max_grad_norm=10)
  with the FusedEMA attached (two launches: scaler.step_and_update).

Models and shapes come from trainfuse.bench.workloads.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn
from torch.nn import functional as F

import trainfuse
from trainfuse._runtime import compat
from trainfuse.bench._common import (
    add_row,
    bench_parser,
    kernel_ms,
    note,
    parse_and_start,
    print_table,
    save_report,
    wall_ms,
)
from trainfuse.bench.workloads import TinyGPT, gpt2_shapes, synthetic_task, yolov5n


def _gpt2_params(dtype=torch.float32):
    ps = [nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in gpt2_shapes()]
    for p in ps:
        p.grad = torch.randn_like(p, dtype=dtype) * 1e-3
    return ps


def bench_cast_fusion(report, bw):
    """AdamW step + bf16 weights for the next forward, GPT-2 124M. Returns torch's fused AdamW
    step alone (kernel ms, wall ms): it makes no bf16 weights, so it is no row of the report."""
    ref = _gpt2_params()
    nparam = sum(p.numel() for p in ref)
    torch_opt = torch.optim.AdamW(ref, lr=1e-4, fused=True)
    cast_src = [p for p in ref]

    def torch_step():
        torch_opt.step()
        return [p.to(torch.bfloat16) for p in cast_src]  # what autocast does, op by op

    ours = [nn.Parameter(p.detach().clone()) for p in ref]
    opt = trainfuse.FusedAdamW(ours, lr=1e-4)
    module = nn.Module()
    for i, p in enumerate(ours):
        module.register_parameter(f"p{i}", p)
    trainfuse.amp.fuse_casts(module, opt, torch.bfloat16)
    for p in ours:
        p.grad = torch.randn_like(p) * 1e-3
    # master r/w 8, m and v r/w 16, bf16 grad read 2, bf16 weight write 2
    floor = 28 * nparam / bw * 1e3
    rows, res = [], {}
    for label, fn in (("torch fused AdamW", torch_opt.step),
                      ("torch fused AdamW + autocast casts", torch_step),
                      ("trainfuse FusedAdamW, fp32 masters -> bf16 weights", opt.step)):
        fn()
        k, w = kernel_ms(fn), wall_ms(fn, iters=50)
        res[label] = (k, w)
    base = res["torch fused AdamW + autocast casts"]
    for label, (k, w) in res.items():
        rows.append([label, f"{k:.3f}", f"{w:.3f}", f"{floor / k * 100:.0f}%", f"{base[0] / k:.2f}x"])
    print_table(f"GPT-2 124M bf16: update + bf16 weights for the next forward ({nparam / 1e6:.0f}M "
                f"params), floor {floor:.3f} ms (28 B/param)",
                ["impl", "kernel ms", "wall ms", "% floor", "vs torch"], rows)
    workload = f"AdamW step + bf16 weights for the next forward, GPT-2 124M ({len(ref)} tensors)"
    for label, (k, w) in res.items():
        if label != "torch fused AdamW":
            add_row(report, workload, label, trainfuse=label.startswith("trainfuse"), do_bench_ms=k,
                    wall_ms=w, floor_ms=floor)
    return {"torch fused AdamW alone": res["torch fused AdamW"]}


def _train_gpt(label, base, x, y, steps, ctx):
    model = TinyGPT(ctx=ctx).cuda()
    model.load_state_dict(base.state_dict())
    if label.startswith("torch"):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    else:
        opt = trainfuse.FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        trainfuse.amp.fuse_casts(model, opt, torch.bfloat16)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = [float(step()) for _ in range(steps)]
    return step, {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / 10}


def bench_small_gpt(report, steps=200, batch=8, ctx=256, rounds=7):
    """Per-step time (forward + backward + step) and loss after ``steps`` steps: autocast + torch
    fused AdamW against fuse_casts + FusedAdamW, from the same initial weights and data. The step
    is host-bound, and the host's speed drifts: the two are timed in alternating windows of 20
    steps, ``rounds`` each, and each reports its median window."""
    torch.manual_seed(0)
    base = TinyGPT(ctx=ctx).cuda()
    x, y = synthetic_task(batch, ctx, 4096)
    labels = ("torch: autocast + fused AdamW", "trainfuse: fuse_casts + FusedAdamW")
    trained = {label: _train_gpt(label, base, x, y, steps, ctx) for label in labels}
    windows = {label: [] for label in labels}
    for _ in range(rounds):
        for label in labels:
            windows[label].append(wall_ms(trained[label][0], iters=20, repeats=1))
    out = {label: {"ms": statistics.median(windows[label]), "windows_ms": windows[label], **trained[label][1]}
           for label in labels}
    ref = out["torch: autocast + fused AdamW"]
    rows = [[k, f"{v['ms']:.3f}", f"{ref['ms'] / v['ms']:.2f}x", f"{v['loss_first']:.4f}",
             f"{v['loss_last']:.4f}", f"{(v['loss_last'] / ref['loss_last'] - 1) * 100:+.2f}%"]
            for k, v in out.items()]
    print_table(f"6-layer d=768 GPT-like, batch {batch} x {ctx} tokens, bf16, fwd+bwd+step; loss = "
                f"mean of steps {steps - 9}..{steps}",
                ["impl", "ms/step", "speedup", "loss step 1", f"loss @{steps}", "vs torch"], rows)
    workload = f"GPT-like 6 x d=768, bf16, forward + backward + step, {batch} x {ctx} tokens"
    for label, v in out.items():
        add_row(report, workload, label, trainfuse=label.startswith("trainfuse"), wall_ms=v["ms"])
    return out


def _yolov5n():
    model = yolov5n()
    if model is None:
        return None
    from ultralytics.utils.torch_utils import ModelEMA

    return model, ModelEMA


def _yolo_groups(model):
    g = {"bn": [], "weight": [], "bias": []}
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            if name == "bias":
                g["bias"].append(p)
            elif isinstance(m, nn.BatchNorm2d):
                g["bn"].append(p)
            else:
                g["weight"].append(p)
    return g


def _sgd(cls, g, **kw):
    opt = cls(g["bn"], lr=0.01, momentum=0.937, nesterov=True, **kw)
    opt.add_param_group({"params": g["weight"], "weight_decay": 5e-4})
    opt.add_param_group({"params": g["bias"], "weight_decay": 0.0})
    return opt


def _stock_phase(model, ModelEMA, kw, set_grads):
    """ultralytics' BaseTrainer.optimizer_step with torch's SGD (default foreach, or fused)."""
    opt = _sgd(torch.optim.SGD, _yolo_groups(model), **kw)
    scaler = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones((), device="cuda"))  # what scaler.scale(loss) does: create the scale
    ema = ModelEMA(model)

    def phase():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ema.update(model)
        set_grads()

    set_grads()
    phase()
    return kernel_ms(phase), wall_ms(phase, iters=100), _stock_pieces(model, opt, scaler, ema)


def _stock_pieces(model, opt, scaler, ema) -> list[float]:
    """The phase as three separate do_bench medians: unscale_ + clip_grad_norm_(10) (the scaler's
    per-optimizer state cleared so it can repeat), the optimizer step and ModelEMA.update, each
    alone; no scaler.update, no zero_grad."""
    def unscale_clip():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        compat.scaler_optimizer_states(scaler).clear()

    return [kernel_ms(unscale_clip), kernel_ms(opt.step), kernel_ms(lambda: ema.update(model))]


def bench_yolo_phase(report, bw):
    got = _yolov5n()
    if got is None:
        note(report, "ultralytics not installed: yolov5n optimizer phase skipped")
        return None
    model, ModelEMA = got
    params = [p for p in model.parameters() if p.requires_grad]
    nparam = sum(p.numel() for p in params)
    grads = [torch.randn_like(p) * 1e-3 for p in params]

    def set_grads():
        for p, g in zip(params, grads):
            p.grad = g

    res = {}
    # stock: ultralytics' BaseTrainer.optimizer_step (torch's default foreach SGD, and fused SGD)
    for label, kw in (("ultralytics stock (foreach SGD)", {}), ("stock with fused SGD", {"fused": True})):
        res[label] = _stock_phase(model, ModelEMA, kw, set_grads)
    opt = _sgd(trainfuse.FusedSGD, _yolo_groups(model), max_grad_norm=10.0)
    scaler = trainfuse.amp.GradScaler("cuda", init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones((), device="cuda"))
    ema = trainfuse.FusedEMA(model)
    opt.attach_ema(ema)

    def ours():
        scaler.step_and_update(opt)
        opt.zero_grad()
        set_grads()

    def ours_step():  # the stock pieces in one call: unscale, clip, SGD, EMA
        scaler.step(opt)
        compat.scaler_optimizer_states(scaler).clear()

    set_grads()
    ours()
    res["trainfuse (GradScaler + FusedSGD max_grad_norm + attached FusedEMA)"] = (
        kernel_ms(ours), wall_ms(ours, iters=100), [kernel_ms(ours_step)])
    # the same without the grad re-assignment the loop needs (it is part of both rows above)
    set_cost = wall_ms(set_grads, iters=100)
    nbuf = sum(b.numel() for b in model.buffers() if b.dtype.is_floating_point)
    # stats pass reads grads 4; update: param r/w 8, grad r/w 8 (the clipped grad is written back),
    # momentum r/w 8, EMA r/w 8; buffers' EMA 12
    floor = ((4 + 32) * nparam + 12 * nbuf) / bw * 1e3
    base = res["ultralytics stock (foreach SGD)"]
    rows = [[k, f"{kk:.3f}", f"{w:.3f}", f"{w - set_cost:.3f}", f"{base[1] / w:.2f}x"]
            for k, (kk, w, _) in res.items()]
    print_table(f"yolov5n optimizer phase: unscale, clip 10, SGD nesterov, EMA ({nparam / 1e6:.2f}M "
                f"params in {len(params)} tensors), floor {floor:.3f} ms; the whole sequence "
                "(+ scaler.update, zero_grad); grads re-attached each "
                f"call ({set_cost:.3f} ms host, subtracted in 'phase ms')",
                ["impl", "kernel ms", "wall ms", "phase ms", "vs stock (wall)"], rows)
    rows = [[k, " + ".join(f"{v:.3f}" for v in pieces), f"{sum(pieces):.3f}",
             f"{sum(base[2]) / sum(pieces):.2f}x"] for k, (_, _, pieces) in res.items()]
    print_table("the same phase timed in pieces: do_bench medians of "
                "unscale_ + clip_grad_norm_(10), the SGD step and ModelEMA.update (stock: three "
                "calls; trainfuse: scaler.step does all three); no scaler.update or zero_grad",
                ["impl", "do_bench ms", "phase ms", "vs stock"], rows)
    workload = (f"yolov5n optimizer phase: unscale, clip 10, SGD nesterov, EMA, scaler.update, zero_grad "
                f"({len(params)} tensors)")
    for label, (k, w, _) in res.items():
        add_row(report, workload, label, trainfuse=label.startswith("trainfuse"), do_bench_ms=k, wall_ms=w,
                phase_ms=w - set_cost, floor_ms=floor)
    return {"set_grads_ms": set_cost, "pieces_do_bench_ms": {k: pieces for k, (_, _, pieces) in res.items()}}


def _times(clip, ps):
    fn = lambda: clip(ps, 1e9)  # noqa: E731
    return kernel_ms(fn), wall_ms(fn)


def bench_clip(report, bw):
    rows = []
    workloads = [("GPT-2 124M", _gpt2_params())]
    got = _yolov5n()
    if got is not None:
        ps = [p for p in got[0].parameters() if p.requires_grad]
        for p in ps:
            p.grad = torch.randn_like(p)
        workloads.append(("yolov5n", ps))
    for name, ps in workloads:
        nparam = sum(p.numel() for p in ps)
        floor = 12 * nparam / bw * 1e3  # read for the norm, read + write to scale
        t = _times(torch.nn.utils.clip_grad_norm_, ps)
        o = _times(trainfuse.amp.clip_grad_norm_, ps)
        workload = f"clip_grad_norm_ (2-norm), {name} ({len(ps)} tensors)"
        for label, (k, w) in (("torch", t), ("trainfuse", o)):
            add_row(report, workload, label, trainfuse=label == "trainfuse", do_bench_ms=k, wall_ms=w,
                    floor_ms=floor)
        rows.append([name, len(ps), f"{t[0]:.3f}", f"{t[1]:.3f}", f"{o[0]:.3f}", f"{o[1]:.3f}",
                     f"{floor / o[0] * 100:.0f}%", f"{t[1] / o[1]:.2f}x"])
    print_table("clip_grad_norm_ (2-norm): torch vs trainfuse", ["workload", "tensors", "torch kernel ms",
                "torch wall ms", "ours kernel ms", "ours wall ms", "% floor", "speedup (wall)"], rows)


CLIP_VALUE = 1e-4  # below most of the random grads' magnitudes: the clamp bites


def _clip_value_times(make):
    """(kernel ms, wall ms) of torch's clip_grad_value_ + fused AdamW and of FusedAdamW with
    max_grad_value, each on its own copy of ``make()``'s params; and their count and size."""
    theirs, ours = make(), make()
    torch_opt = torch.optim.AdamW(theirs, lr=1e-4, fused=True)
    fused_opt = trainfuse.FusedAdamW(ours, lr=1e-4, max_grad_value=CLIP_VALUE)

    def torch_step():
        torch.nn.utils.clip_grad_value_(theirs, CLIP_VALUE)
        torch_opt.step()

    t = kernel_ms(torch_step), wall_ms(torch_step)
    o = kernel_ms(fused_opt.step), wall_ms(fused_opt.step)
    return t, o, len(ours), sum(p.numel() for p in ours)


def bench_clip_value(report, bw):
    """AdamW step with clipping by value: torch's clip_grad_value_ then fused AdamW, against
    FusedAdamW(max_grad_value=...), whose update clamps the unscaled grads and writes them back."""
    rows = []
    workloads = [("GPT-2 124M", _gpt2_params)]
    got = _yolov5n()
    if got is not None:
        def yolo_params():
            ps = [nn.Parameter(p.detach().clone()) for p in got[0].parameters() if p.requires_grad]
            for p in ps:
                p.grad = torch.randn_like(p) * 1e-3
            return ps
        workloads.append(("yolov5n", yolo_params))
    for name, make in workloads:
        t, o, ntensors, nparam = _clip_value_times(make)
        # param r/w 8, grad read 4 + clipped grad written back 4, exp_avg r/w 8, exp_avg_sq r/w 8
        floor = 32 * nparam / bw * 1e3
        workload = f"AdamW + clip by value, {name} ({ntensors} tensors)"
        if name != "yolov5n":  # the README's summary keeps one clip-by-value row
            report.setdefault("summary_skip", []).append(workload)
        for label, (k, w) in (("torch fused + clip_grad_value_", t), ("trainfuse", o)):
            add_row(report, workload, label, trainfuse=label == "trainfuse", do_bench_ms=k, wall_ms=w,
                    floor_ms=floor)
        rows.append([name, ntensors, f"{t[0]:.3f}", f"{t[1]:.3f}", f"{o[0]:.3f}", f"{o[1]:.3f}",
                     f"{floor / o[0] * 100:.0f}%", f"{t[1] / o[1]:.2f}x"])
    print_table("AdamW + clipping by value: torch vs trainfuse", ["workload", "tensors", "torch kernel ms",
                "torch wall ms", "ours kernel ms", "ours wall ms", "% floor", "speedup (wall)"], rows)


def main(argv=None):
    parser = bench_parser("amp", __doc__, only="casts, gpt, clip, clip-value or yolo")
    parser.add_argument("--steps", type=int, default=200, help="training steps of the GPT-like model")
    parser.add_argument("--gpt-batches", default="8,32",
                        help="batch sizes (x 256 tokens) of the GPT-like model, comma separated")
    started = parse_and_start(parser, argv, "amp")
    if started is None:
        return
    args, report, bw = started
    gpt = lambda: {b: bench_small_gpt(report, args.steps, batch=int(b))  # noqa: E731
                   for b in args.gpt_batches.split(",")}
    for key, fn in (("casts", lambda: bench_cast_fusion(report, bw)),
                    ("clip", lambda: bench_clip(report, bw)),
                    ("clip-value", lambda: bench_clip_value(report, bw)),
                    ("yolo", lambda: bench_yolo_phase(report, bw)), ("gpt", gpt)):
        if args.only in ("", key):
            details = fn()
            if details is not None:
                report[key] = details
            torch.cuda.empty_cache()
    save_report(report, args.out, "amp")


__all__ = ["main"]
