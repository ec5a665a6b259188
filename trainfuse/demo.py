"""``python -m trainfuse.demo``: train a small model with torch.optim.AdamW and FusedAdamW side by
side, show they learn the same thing, and, on a CUDA GPU, time the optimizer step.

Without a GPU both optimizers run torch's own CPU kernels (FusedAdamW's torch fallback), so the
demo checks that the two train alike and times nothing: a step time there would compare torch
with itself.
"""

from __future__ import annotations

import sys
import time

import torch

import trainfuse

# (training steps, batch rows) per device: the CPU run is sized to finish in seconds on two cores
SIZES = {"cuda": (60, 512), "cpu": (20, 128)}
WIDTH, DEPTH = 256, 24


def _model(device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1)).to(device)


def _run(label: str, opt_cls, device: torch.device, steps: int, batch: int,
         **kw) -> tuple[list[float], float, int]:
    """Train one model; returns its losses, the median optimizer step in ms and its tensor count.
    Shows its progress on one line of stderr (updated every step on a terminal, else once at the
    end)."""
    model = _model(device)
    opt = opt_cls(model.parameters(), lr=1e-3, weight_decay=0.01, **kw)
    torch.manual_seed(1)
    x = torch.randn(batch, WIDTH, device=device)
    y = x[:, :8].sum(1, keepdim=True).sin()
    losses, step_times = [], []
    live = sys.stderr.isatty()
    back = "\r" if live else ""  # a terminal rewrites the line in place
    start = time.perf_counter()
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        last = step + 1 == steps
        if last or live:
            print(f"{back}  {label}: step {step + 1}/{steps}, loss {losses[-1]:.5f}, "
                  f"{time.perf_counter() - start:.1f} s", end="\n" if last else "", flush=True,
                  file=sys.stderr)
    return losses, sorted(step_times)[len(step_times) // 2] * 1e3, len(list(model.parameters()))


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    if not gpu:
        # 256-wide layers gain nothing from more threads, and with other processes on the cores
        # torch's threads wait on each other: a run took 8-25 s with two threads, 0.5 s with one
        torch.set_num_threads(1)
    print(trainfuse.describe())
    steps, batch = SIZES[device.type]
    kw = {"fused": True} if gpu else {}
    label = "torch.optim.AdamW" + (" (fused=True)" if kw else "")
    print(f"training a {DEPTH}-block MLP for {steps} steps (batch {batch}) on {device}, once per optimizer:",
          flush=True)
    ref_losses, ref_ms, ntensors = _run(label, torch.optim.AdamW, device, steps, batch, **kw)
    our_losses, our_ms, _ = _run("trainfuse.FusedAdamW", trainfuse.FusedAdamW, device, steps, batch)
    print(f"model: {ntensors} parameter tensors")
    header = f"{'optimizer':<32}{'loss start':>12}{'loss end':>12}"
    print(header + (f"{'step ms':>10}" if gpu else ""))
    for name, losses, ms in ((label, ref_losses, ref_ms), ("trainfuse.FusedAdamW", our_losses, our_ms)):
        print(f"{name:<32}{losses[0]:>12.5f}{losses[-1]:>12.5f}" + (f"{ms:>10.3f}" if gpu else ""))
    drift = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(our_losses, ref_losses))
    print(f"largest relative loss difference over the run: {drift:.2e}")
    if gpu:
        print(f"optimizer step speedup over {label}: {ref_ms / our_ms:.2f}x")
    else:
        print("no step times: without a GPU both optimizers run torch's own CPU kernels, so timing them\n"
              "would compare torch with itself. On a CUDA GPU this demo times FusedAdamW's Triton kernel\n"
              "against torch's fused AdamW.")


if __name__ == "__main__":
    main()
