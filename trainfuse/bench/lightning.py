"""Lightning benchmark: stock Lightning runs against the same runs with FusedTraining().

Two workloads, each trained by ``Trainer.fit`` on one GPU, alternating stock and fused runs:

- GPT-like: 6 layers, d=768, vocab 8192, batch 8 x 256 tokens, bf16-mixed, AdamW lr 3e-4 wd 0.1,
  gradient_clip_val=1.0, EMA 0.999. Stock = foreach AdamW + Trainer clipping + EMAWeightAveraging
  (AdamW(fused=True) is refused there: Lightning cannot clip it). Data: a deterministic token
  stream from a sparse random bigram language (every batch new, nothing repeats).
- tabular: MLP 4 x 1024 GELU + head, BCEWithLogitsLoss, batch 8192, bf16-mixed, AdamW lr 1e-3,
  gradient_clip_val=1.0. Data: fresh Gaussian rows every batch, labels from their signs.
- gpt-muon (``--only gpt-muon``, report ``lightning-gpt-muon``): the GPT-like model as Muon's users
  train it: ``torch.optim.Muon`` (lr 0.02, wd 0.1) on the blocks' matrices and AdamW on the rest,
  both stepped by the module (manual optimization), each clipped at 1.0 by ``clip_gradients``; no
  EMA. Its optimizer phase is timed from the first optimizer's step.

Three runs per pair: stock, ``FusedTraining()``, and ``FusedTraining(cuda_graphs=True)`` (the
model's forward and backward replayed from CUDA graphs).

Per run: the median step time (synchronized at batch start and end, after warm-up), the optimizer
phase alone (clip + step + EMA: from ``on_before_optimizer_step`` to the end of the batch,
synchronized at both ends on every 5th step, which the step median leaves out), the final loss
(mean of the last 10 steps), and the peak GPU memory above what the data holds: allocated
(``max_memory_allocated``) and reserved (``max_memory_reserved``, which counts the CUDA graphs'
memory pool whole). Triple k of the ``--repeats`` runs starts from model and
data seed k; the loss goal compares the final losses averaged over the seeds. ``--breakdown`` adds
each phase's host time (no syncs: where a host-bound step spends it); ``--profile`` prints
torch.profiler's top ops for a few steps of each run and writes their Chrome traces. The plot is
``<out>/lightning.png``.

``--devices N`` (N > 1) trains each run with ``strategy="ddp"`` on N GPUs, the per-GPU batch as
above and each rank its share of the data (GPT: every N-th sequence of one corpus; tabular: rows
from seed ``1000 * seed + rank``). Lightning starts the other
ranks by running the same command again; they train alongside and write nothing. Rank zero's
times hold the wait for the gradient all-reduce. The report is ``lightning-<N>gpus``; the same
command without ``--devices`` gives the one-GPU numbers to scale against.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import warnings

import torch
from torch import nn

from trainfuse.bench._common import add_row, bench_parser, note, parse_and_start, print_table, save_report
from trainfuse.bench.lightning_plot import plot
from trainfuse.lightning import FusedTraining
from trainfuse.lightning._compat import installed

V, D, HEADS, LAYERS, T, GPT_BATCH = 8192, 768, 12, 6, 256, 8
TAB_IN, TAB_WIDTH, TAB_OUT, TAB_BATCH = 256, 1024, 16, 8192
DEVICE = "cuda"  # the tests run the same code on "cpu" with tiny sizes
DEVICES = 1  # GPUs per run (--devices); above 1, DDP
PHASE_EVERY = 5  # steps timed with a sync before the optimizer phase (left out of the step median)
WARMUP = 10
# goals: step >= 1.2x, optimizer phase >= 5x (GPT), final loss within 1 % of stock; with CUDA
# graphs, the step per workload against stock, and peak reserved memory within 1.3x of the same
# run without graphs
GOALS = {"step": 1.2, "optimizer": 5.0, "loss": 0.01, "memory": 1.3}
GRAPH_GOALS = {"gpt": 1.6, "tabular": 2.0, "gpt-muon": 5.0}
# under DDP (--devices N): the step against stock DDP, without and with graphs
DDP_GOALS = {"step": 1.6, "graphs": 4.0}
VARIANTS = ("stock", "fused", "graphs")
LABELS = {"stock": "Lightning stock", "fused": "Lightning fused", "graphs": "Lightning fused + CUDA graphs"}


def bigram_corpus(sequences: int, length: int, seed: int = 0, successors: int = 8) -> torch.Tensor:
    """``sequences`` token sequences of ``length`` from a fixed random bigram language: each token
    has ``successors`` possible next tokens with Zipf-like weights (learnable, never repeated)."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, V, (V, successors), generator=g)
    weights = 1.0 / torch.arange(1, successors + 1, dtype=torch.float32)
    out = torch.empty(sequences, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, V, (sequences,), generator=g)
    for t in range(1, length):
        pick = torch.multinomial(weights.expand(sequences, -1), 1, generator=g).squeeze(1)
        out[:, t] = succ[out[:, t - 1], pick]
    return out


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _rank() -> int:
    """This process's rank among a DDP run's (0 before Lightning starts the others)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _device() -> str:
    return f"cuda:{_rank()}" if DEVICE == "cuda" and DEVICES > 1 else DEVICE


def _trainer(pl, steps: int, callbacks: list, muon: bool = False):
    """A Trainer for ``steps`` batches; ``muon``: the gpt-muon module steps and clips its two
    optimizers itself (no Trainer clipping, and Lightning counts both steps)."""
    ddp = {"strategy": "ddp", "use_distributed_sampler": False} if DEVICES > 1 else {}
    return pl.Trainer(accelerator="gpu" if DEVICE == "cuda" else "cpu", devices=DEVICES,
                      precision="bf16-mixed", max_steps=2 * steps if muon else steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      gradient_clip_val=None if muon else 1.0, callbacks=callbacks, **ddp)


def _data(workload: str, steps: int, seed: int = 0) -> torch.utils.data.DataLoader:
    """``steps`` batches of the workload's data, on the device (this rank's, under DDP)."""
    device, rank = _device(), _rank()
    if workload.startswith("gpt"):  # under DDP, rank r takes every DEVICES-th sequence of one corpus
        tokens = bigram_corpus(steps * GPT_BATCH * DEVICES, T + 1, seed=seed)[rank::DEVICES].to(device)
        return _batches((tokens[:, :-1], tokens[:, 1:]), GPT_BATCH)
    g = torch.Generator(device=device).manual_seed(1000 * seed + rank if DEVICES > 1 else seed)
    x = torch.randn(steps * TAB_BATCH, TAB_IN, device=device, generator=g)
    return _batches((x, (x[:, :TAB_OUT] > 0).float()), TAB_BATCH)


def _callbacks(pl, workload: str, variant: str, verbose: bool) -> list:
    """FusedTraining (with the EMA on the GPT; ``graphs``: with CUDA graphs) or, for stock,
    EMAWeightAveraging on the GPT."""
    gpt = workload == "gpt"  # (gpt-muon: two optimizers, no EMA)
    if variant != "stock":
        return [FusedTraining(ema_decay=0.999 if gpt else None, verbose=verbose,
                              cuda_graphs=variant == "graphs")]
    return [pl.callbacks.EMAWeightAveraging(decay=0.999)] if gpt else []


def _batches(tensors: tuple[torch.Tensor, ...], batch: int) -> torch.utils.data.DataLoader:
    """A loader that slices whole batches (one gather each) from tensors already on the GPU."""
    ds = torch.utils.data.TensorDataset(*tensors)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), batch, drop_last=True)
    return torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=None)


def make_gpt(pl, seed: int = 0, muon: bool = False):
    """The GPT-like module; ``muon``: Muon on the blocks' matrices and AdamW on the rest, stepped
    and clipped by the module (manual optimization)."""
    class GPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = not muon
            torch.manual_seed(seed)
            self.emb = nn.Embedding(V, D)
            self.blocks = nn.ModuleList([
                nn.TransformerEncoderLayer(D, HEADS, 4 * D, 0.0, "gelu", batch_first=True, norm_first=True)
                for _ in range(LAYERS)])
            self.ln = nn.LayerNorm(D)
            self.head = nn.Linear(D, V)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T), persistent=False)
            self.losses = []

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = block(h, src_mask=self.mask, is_causal=True)
            return self.head(self.ln(h))

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())
            self.losses.append(loss.detach())
            if not muon:
                return loss
            opts = self.optimizers()
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in opts:
                self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
                opt.step()
            return None

        def configure_optimizers(self):
            if not muon:
                return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)
            matrices = [p for p in self.blocks.parameters() if p.ndim == 2]
            taken = {id(p) for p in matrices}
            rest = [p for p in self.parameters() if id(p) not in taken]
            return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
                    torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1)]

    return GPT()


def make_tabular(pl, seed: int = 0):
    class Tabular(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            layers = []
            for k in range(4):
                layers += [nn.Linear(TAB_IN if k == 0 else TAB_WIDTH, TAB_WIDTH), nn.GELU()]
            self.body = nn.Sequential(*layers)
            self.head = nn.Linear(TAB_WIDTH, TAB_OUT)
            self.crit = nn.BCEWithLogitsLoss()
            self.losses = []

        def training_step(self, batch, i):
            x, y = batch
            loss = self.crit(self.head(self.body(x)).float(), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Tabular()


def make_timer(pl, breakdown: bool):
    class Timer(pl.Callback):
        """Step and optimizer-phase times (synchronized), or host time per phase (``breakdown``)."""

        def __init__(self):
            self.step, self.optimizer, self.host = [], [], {}
            self.n = 0

        def _mark(self, name):
            self.marks.append((name, time.perf_counter()))

        def on_train_batch_start(self, *args):
            self.n += 1
            self.phase = not breakdown and self.n % PHASE_EVERY == 0
            if not breakdown:
                _sync()
            self.marks = []
            self._mark("start")

        def on_before_backward(self, *args):
            if breakdown:
                self._mark("forward")

        def on_after_backward(self, *args):
            if breakdown:
                self._mark("backward")

        def on_before_optimizer_step(self, *args):
            if any(name == "before step" for name, _ in self.marks):  # a second optimizer's step
                return
            if self.phase:
                _sync()
            self._mark("before step")

        def on_train_batch_end(self, *args):
            if not breakdown:
                _sync()
            self._mark("end")
            if self.n <= WARMUP:
                return
            t = dict(self.marks)
            if breakdown:
                for (a, ta), (b, tb) in zip(self.marks, self.marks[1:]):
                    self.host.setdefault(f"{a} -> {b}", []).append((tb - ta) * 1e3)
            elif self.phase:
                self.optimizer.append((t["end"] - t["before step"]) * 1e3)
            else:
                self.step.append((t["end"] - t["start"]) * 1e3)

    return Timer()


def _memory_start() -> tuple[int, int]:
    if DEVICE != "cuda":
        return 0, 0
    gc.collect()  # the last run's Trainer and module hold each other: free them before measuring
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def run(pl, workload: str, variant: str, steps: int, args, seed: int = 0) -> dict:
    """One Trainer.fit of ``workload`` (``variant``: stock, fused, graphs) from model and data seed
    ``seed``; its timings, losses and peak memory."""
    loader = _data(workload, steps, seed)
    allocated, reserved = _memory_start()
    muon = workload == "gpt-muon"
    module = make_tabular(pl, seed) if workload == "tabular" else make_gpt(pl, seed, muon=muon)
    timer = make_timer(pl, args.breakdown)
    callbacks = _callbacks(pl, workload, variant, args.verbose)
    # the timer last: its batch end follows the EMA; manual optimization clips in the module
    trainer = _trainer(pl, steps, [*callbacks, timer], muon=muon)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|bottleneck).*")
        trainer.fit(module, loader)
    losses = torch.stack(module.losses).float().cpu()
    out = {"losses": losses.tolist(), "final_loss": float(losses[-10:].mean())}
    if DEVICE == "cuda":
        out["peak_allocated_gb"] = (torch.cuda.max_memory_allocated() - allocated) / 2**30
        out["peak_reserved_gb"] = (torch.cuda.max_memory_reserved() - reserved) / 2**30
    if args.breakdown:
        out["host_ms"] = {k: statistics.median(v) for k, v in timer.host.items()}
    else:
        out["step_ms"] = statistics.median(timer.step)
        out["optimizer_ms"] = statistics.median(timer.optimizer)
    if variant != "stock":
        out["report"] = [r.__dict__ for r in callbacks[0].report]
    if variant == "graphs":
        out["graph_stats"] = {k: v.__dict__ for k, v in callbacks[0].graph_stats.items()}
        out["overlapped_steps"] = callbacks[0].overlapped_steps
        out["graph_reasons"] = {k: {str(key): why for key, why in v.items()}
                                for k, v in callbacks[0].graph_reasons.items()}
    return out


def profile(pl, workload: str, variant: str, out_dir: str) -> None:
    """torch.profiler over 5 steps after warm-up: the top ops and a Chrome trace."""
    from torch.profiler import ProfilerActivity, schedule

    name = f"{workload}-{variant}"

    class Prof(pl.Callback):
        def on_train_start(self, *args):
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
            self.p = torch.profiler.profile(activities=activities,
                                            schedule=schedule(wait=1, warmup=WARMUP, active=5, repeat=1))
            self.p.start()

        def on_train_batch_end(self, *args):
            self.p.step()

        def on_train_end(self, *args):
            self.p.stop()

    prof = Prof()
    muon = workload == "gpt-muon"
    module = make_tabular(pl) if workload == "tabular" else make_gpt(pl, muon=muon)
    steps = WARMUP + 8
    trainer = _trainer(pl, steps, [*_callbacks(pl, workload, variant, False), prof], muon=muon)
    loader = _data(workload, steps)
    trainer.fit(module, loader)
    print(f"\ntorch.profiler, {name}: 5 steps")
    print(prof.p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    path = os.path.join(out_dir, f"lightning-{name}.trace.json")
    prof.p.export_chrome_trace(path)
    print(f"trace: {path}")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: medians of the times and peaks over the runs, the mean final loss over the seeds
    (one run's final loss moves by a few % with any rounding difference, stock bf16 against stock
    32-true included)."""
    def median(rs, key):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {v: {"step_ms": median(rs, "step_ms"), "optimizer_ms": median(rs, "optimizer_ms"),
                "peak_allocated_gb": median(rs, "peak_allocated_gb"),
                "peak_reserved_gb": median(rs, "peak_reserved_gb"),
                "final_loss": statistics.fmean(r["final_loss"] for r in rs),
                "final_losses": [r["final_loss"] for r in rs]}
            for v, rs in runs.items()}


def add_rows(report: dict, workload: str, med: dict[str, dict]) -> None:
    """The report's rows for one workload: the step stock against FusedTraining(), the step stock
    against FusedTraining(cuda_graphs=True) (a workload of its own, so the README's summary shows
    both), and the optimizer phase of all three."""
    step = f"{workload}: training step"
    for v, name in (("stock", step), ("fused", step), ("stock", f"{step}, cuda_graphs=True"),
                    ("graphs", f"{step}, cuda_graphs=True")):
        add_row(report, name, LABELS[v], trainfuse=v != "stock", wall_ms=med[v]["step_ms"])
    phase = f"{workload}: optimizer phase (clip + step + EMA)"
    for v in VARIANTS:
        add_row(report, phase, LABELS[v], trainfuse=v != "stock", wall_ms=med[v]["optimizer_ms"])
    # the README's summary keeps the steps; the phases are in docs/performance.md
    report.setdefault("summary_skip", []).append(phase)


def _goals(workload: str, med: dict[str, dict]) -> list[str]:
    """The goals' lines for one workload: met or missed, with the measured figure."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    stock, fused, graphs = med["stock"], med["fused"], med["graphs"]
    step_x = stock["step_ms"] / fused["step_ms"]
    graph_x = stock["step_ms"] / graphs["step_ms"]
    opt_x = stock["optimizer_ms"] / fused["optimizer_ms"]
    step_goal = GOALS["step"] if DEVICES == 1 else DDP_GOALS["step"]
    lines = [f"step {step_x:.2f}x ({verdict(step_x >= step_goal)} >= {step_goal}x)"]
    if workload == "gpt":
        goal = GOALS["optimizer"]
        lines.append(f"optimizer {opt_x:.2f}x ({verdict(opt_x >= goal)} >= {goal}x)")
    goal = GRAPH_GOALS[workload] if DEVICES == 1 else DDP_GOALS["graphs"]
    lines.append(f"step with CUDA graphs {graph_x:.2f}x ({verdict(graph_x >= goal)} >= {goal}x)")
    for v in ("fused", "graphs"):
        rel = abs(med[v]["final_loss"] - stock["final_loss"]) / stock["final_loss"]
        lines.append(f"{v} loss {rel * 100:.2f}% ({verdict(rel <= GOALS['loss'])} <= 1%)")
    if graphs["peak_reserved_gb"] is not None and fused["peak_reserved_gb"]:
        mem = graphs["peak_reserved_gb"] / fused["peak_reserved_gb"]
        lines.append(f"peak reserved memory with graphs {mem:.2f}x the run without "
                     f"({verdict(mem <= GOALS['memory'])} <= {GOALS['memory']}x)")
    return lines


def main(argv: list[str] | None = None) -> dict | None:
    parser = bench_parser("lightning", __doc__, only="gpt, tabular (default: both) or gpt-muon")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 steps each, one repeat")
    parser.add_argument("--gpt-steps", type=int, default=300)
    parser.add_argument("--tabular-steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3,
                        help="stock/fused/graphs run triples per workload, triple k from seed k")
    parser.add_argument("--breakdown", action="store_true",
                        help="host ms per step phase (no syncs) instead of synchronized timings")
    parser.add_argument("--profile", action="store_true", help="torch.profiler top ops and Chrome traces")
    parser.add_argument("--verbose", action="store_true", help="print FusedTraining's report each run")
    parser.add_argument("--devices", type=int, default=1, help="GPUs per run; above 1, strategy='ddp'")
    started = parse_and_start(parser, argv, "Lightning")
    if started is None:
        return None
    args, report, _ = started
    global DEVICES
    DEVICES = args.devices
    family = "lightning" if DEVICES == 1 else f"lightning-{DEVICES}gpus"
    if args.only == "gpt-muon":
        family = family.replace("lightning", "lightning-gpt-muon")
    report["_bench"] = "lightning"
    pl = installed()[0]
    workloads = ["gpt-muon"] if args.only == "gpt-muon" else [w for w in ("gpt", "tabular")
                                                               if args.only in ("", w)]
    gpt_steps = 40 if args.quick else args.gpt_steps
    steps = {"gpt": gpt_steps, "gpt-muon": gpt_steps, "tabular": 40 if args.quick else args.tabular_steps}
    repeats = 1 if args.quick else args.repeats
    os.makedirs(args.out, exist_ok=True)
    if args.profile:
        for w in workloads:
            for variant in VARIANTS:
                profile(pl, w, variant, args.out)
    results = {w: {v: [] for v in VARIANTS} for w in workloads}
    for w in workloads:
        for seed in range(repeats):  # each triple from its own seed: the final loss is averaged over them
            for variant in VARIANTS:
                results[w][variant].append(run(pl, w, variant, steps[w], args, seed))
    if _rank() != 0:  # another DDP rank: it trained alongside rank zero, which reports
        return None
    report.update(steps=steps, repeats=repeats, lightning=f"{pl.__name__} {pl.__version__}", runs=results,
                  devices=DEVICES)
    if args.breakdown:
        for w in workloads:
            rows = []
            for variant in VARIANTS:
                for phase, ms in results[w][variant][0]["host_ms"].items():
                    rows.append([variant, phase, f"{ms:.3f}"])
            print_table(f"{w}: host ms per phase (median, no syncs)", ["run", "phase", "host ms"], rows)
        save_report(report, args.out, family)
        return report
    rows = []
    for w in workloads:
        med = _summary(results[w])
        add_rows(report, w if DEVICES == 1 else f"{w} on {DEVICES} GPUs (DDP)", med)
        note(report, f"{w}: " + "; ".join(_goals(w, med)))
        rows += [[w, v, f"{med[v]['step_ms']:.3f}", f"{med['stock']['step_ms'] / med[v]['step_ms']:.2f}x",
                  f"{med[v]['optimizer_ms']:.3f}", _num(med[v]["peak_allocated_gb"]),
                  _num(med[v]["peak_reserved_gb"]), f"{med[v]['final_loss']:.4f}",
                  " ".join(f"{x:.4f}" for x in med[v]["final_losses"])]
                 for v in VARIANTS]
    print_table(f"Lightning fit, bf16-mixed, clip 1.0 (medians over {repeats} run(s), steps {steps})",
                ["workload", "run", "ms/step", "vs stock", "optimizer ms", "peak alloc GB",
                 "peak reserved GB", "final loss (mean)", "per seed"], rows)
    png = plot(results, os.path.join(args.out, f"{family}.png"), VARIANTS, LABELS)
    if png is None:
        note(report, "matplotlib not installed: no plot")
    else:
        print(f"plot: {png}")
    save_report(report, args.out, family)
    return report


__all__ = ["add_rows", "bigram_corpus", "main"]
