"""``python -m trainfuse.demo``: train a small model with torch.optim.AdamW and FusedAdamW side by
side, show they learn the same thing, and time the optimizer step."""

from __future__ import annotations

import time

import torch

import trainfuse


def _model(device):
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 1)).to(device)


def _run(opt_cls, device, steps, **kw):
    model = _model(device)
    opt = opt_cls(model.parameters(), lr=1e-3, weight_decay=0.01, **kw)
    torch.manual_seed(1)
    x = torch.randn(512, 256, device=device)
    y = x[:, :8].sum(1, keepdim=True).sin()
    losses, step_times = [], []
    for _ in range(steps):
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
    return losses, sorted(step_times)[len(step_times) // 2] * 1e3, len(list(model.parameters()))


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(trainfuse.describe())
    steps = 60
    kw = {"fused": True} if device.type == "cuda" else {}
    ref_losses, ref_ms, ntensors = _run(torch.optim.AdamW, device, steps, **kw)
    our_losses, our_ms, _ = _run(trainfuse.FusedAdamW, device, steps)
    label = "torch.optim.AdamW" + (" (fused=True)" if kw else "")
    print(f"model: {ntensors} parameter tensors, {steps} training steps on {device}")
    print(f"{'optimizer':<32}{'loss start':>12}{'loss end':>12}{'step ms':>10}")
    print(f"{label:<32}{ref_losses[0]:>12.5f}{ref_losses[-1]:>12.5f}{ref_ms:>10.3f}")
    print(f"{'trainfuse.FusedAdamW':<32}{our_losses[0]:>12.5f}{our_losses[-1]:>12.5f}{our_ms:>10.3f}")
    drift = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(our_losses, ref_losses))
    print(f"largest relative loss difference over the run: {drift:.2e}")
    if device.type == "cuda":
        print(f"optimizer step speedup over {label}: {ref_ms / our_ms:.2f}x")
    else:
        print("(on CPU both run torch's own kernels; the fused Triton path needs a CUDA GPU)")


if __name__ == "__main__":
    main()
