"""The PNG of ``python -m trainfuse.bench lightning``: step and optimizer-phase times, loss curves."""

from __future__ import annotations

import statistics


def plot(results: dict, path: str, variants: tuple[str, ...], labels: dict[str, str]) -> str | None:
    """Step and optimizer-phase bars per workload and the loss curves of ``results`` (per workload,
    per variant, the runs of :func:`trainfuse.bench.lightning.run`), as a PNG at ``path``; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workloads = list(results)
    colors = {"stock": "tab:gray", "fused": "tab:orange", "graphs": "tab:red"}
    fig, axes = plt.subplots(1, 2 + len(workloads), figsize=(5 * (2 + len(workloads)), 4))
    panels = ((axes[0], "step_ms", "ms per step"), (axes[1], "optimizer_ms", "optimizer phase ms"))
    width = 0.8 / len(variants)
    for ax, key, title in panels:
        for k, variant in enumerate(variants):
            vals = [statistics.median(r[key] for r in results[w][variant]) for w in workloads]
            ax.bar([i + width * k for i in range(len(workloads))], vals, width, label=labels[variant],
                   color=colors[variant])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        ax.set_title(title)
        ax.legend(fontsize="small")
    for ax, w in zip(axes[2:], workloads):
        for variant in variants:
            ax.plot(results[w][variant][0]["losses"], label=labels[variant], color=colors[variant],
                    linewidth=0.8)
        ax.set_title(f"{w}: training loss")
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


__all__ = ["plot"]
