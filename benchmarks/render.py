"""Render the committed benchmark results into the README's and the docs' tables and into PNGs.

    python benchmarks/render.py           # rewrite the marked blocks and the PNGs
    python benchmarks/render.py --check   # exit 1 where a marked block is out of date

Input: ``benchmarks/results/<gpu>/<family>.json``, as ``python -m trainfuse.bench <family> --out
benchmarks/results/<gpu>`` writes it (schema: trainfuse/bench/_common.py). Output, between a
file's ``<!-- results:<name>:begin -->`` and ``<!-- results:<name>:end -->``:

- ``headline`` (README.md): the workloads of :data:`HEADLINE` on :data:`HEADLINE_GPU`, each one's
  first trainfuse row against its fastest torch row on the report's headline metric;
- ``summary`` (docs/performance.md): one such table per GPU with every workload (less those a
  report lists under ``details.summary_skip``, a sweep's points);
- ``<family>`` (docs/performance.md): every row of that family, per GPU;

and ``benchmarks/results/<gpu>/<family>.png``: the headline metric per workload and implementation
(needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGETS = [ROOT / "README.md", ROOT / "docs" / "performance.md"]
SCHEMA = 1
FAMILY_ORDER = ["optim", "amp", "ema", "losses", "mlp", "lightning", "yolo", "yolo-yolov5s", "yolo-loss"]
LABELS = {"do_bench_ms": "do_bench ms", "wall_ms": "wall ms", "host_ms": "host ms",
          "graph_ms": "GPU ms (graph)", "phase_ms": "phase ms", "floor_ms": "floor ms", "tflops": "TFLOP/s"}
MARKER = re.compile(r"<!-- results:([\w-]+):begin -->\n.*?<!-- results:\1:end -->", re.S)
# the README's table: (family, workload) on one GPU, a handful of the workloads users run most
HEADLINE_GPU = "h200"
_DEFAULT_RUN = ("yolov5n default train(): 20 epochs, 2048 photo-like JPEGs, 512 to validate each epoch: "
                "wall clock of train()")
_LONG_RUN = ("yolov5n default train(): 100 epochs, 1024 photo-like JPEGs, 256 to validate each epoch: "
             "wall clock of train()")
_BLOCKS = "batch 16 imgsz 640 fuse_blocks=True TRAINFUSE_FUSE_CONCAT=1"  # what detection gets by default
HEADLINE = (
    ("yolo-default-run", f"{_DEFAULT_RUN}, cold caches"),
    ("yolo-default-run", f"{_DEFAULT_RUN}, warm caches"),
    ("yolo-default-run-100-epochs-1024-images", f"{_LONG_RUN}, cold caches"),
    ("yolo-default-run-100-epochs-1024-images", f"{_LONG_RUN}, warm caches"),
    ("optim", "AdamW, GPT-2 124M (148 tensors, 124.5M params)"),
    ("optim", "AdamW, yolov5n (219 tensors, 2.7M params)"),
    ("lightning", "gpt: training step, cuda_graphs=True"),
    ("yolo", "yolov5n.yaml batch 16 imgsz 640: training-loop iteration"),
    ("yolo-yolo26n", "yolo26n.yaml batch 16 imgsz 640: training-loop iteration"),
    ("yolo-yolo11s", "yolo11s.yaml batch 16 imgsz 640: training-loop iteration"),
    ("yolo-yolo11m", "yolo11m.yaml batch 16 imgsz 640: training-loop iteration"),
    ("yolo-yolo11l-fuse-blocks-fuse-concat", f"yolo11l.yaml {_BLOCKS}: training-loop iteration"),
    ("yolo-yolo11n-seg-fused-loss",
     "yolo11n-seg.yaml batch 16 imgsz 640 fused_loss=True: training-loop iteration"),
    ("yolo-yolo11n-pose-fused-loss",
     "yolo11n-pose.yaml batch 16 imgsz 640 fused_loss=True: training-loop iteration"),
    ("yolo-yolo26n-pose", "yolo26n-pose.yaml batch 16 imgsz 640: training-loop iteration"),
    ("yolo-yolo11n-obb-fused-loss",
     "yolo11n-obb.yaml batch 16 imgsz 640 fused_loss=True: training-loop iteration"),
    ("yolo-yolo11n-cls", "yolo11n-cls.yaml batch 64 imgsz 224: training-loop iteration"),
    ("yolo-loss", "loss forward + backward, yolov5n batch 16, 640 px, nc 80, AMP fp16 predictions"),
)


def load_results(root: Path = RESULTS) -> dict[str, dict[str, dict]]:
    """Every ``<gpu>/<family>.json`` under ``root``: ``{gpu: {family: report}}``, GPUs sorted by
    name and families in :data:`FAMILY_ORDER` (unknown ones last, by name)."""
    out: dict[str, dict[str, dict]] = {}
    rank = {f: i for i, f in enumerate(FAMILY_ORDER)}
    for gpu_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        files = sorted(gpu_dir.glob("*.json"), key=lambda p: (rank.get(p.stem, len(rank)), p.stem))
        reports = {}
        for path in files:
            report = json.loads(path.read_text())
            if report.get("schema") != SCHEMA:
                raise ValueError(f"{path}: schema {report.get('schema')!r}, expected {SCHEMA}")
            if report.get("family") != path.stem:
                raise ValueError(f"{path}: family {report.get('family')!r} does not match the file name")
            reports[path.stem] = report
        if reports:
            out[gpu_dir.name] = reports
    return out


def fmt(key: str, value: float | None) -> str:
    """A metric for a table: milliseconds to 3 decimals (4 under 0.1 ms), TFLOP/s whole."""
    if value is None:
        return ""
    if key == "tflops":
        return f"{value:.0f}"
    return f"{value:.4f}" if value < 0.1 else f"{value:.3f}"


def by_workload(report: dict) -> dict[str, list[dict]]:
    """The report's rows grouped by workload, in the order they were measured."""
    groups: dict[str, list[dict]] = {}
    for row in report["rows"]:
        groups.setdefault(row["workload"], []).append(row)
    return groups


def compared(rows: list[dict], metric: str) -> tuple[dict | None, dict | None]:
    """``(fastest torch row, first trainfuse row)`` of one workload on ``metric`` (None if absent)."""
    theirs = [r for r in rows if not r["trainfuse"] and r.get(metric) is not None]
    ours = [r for r in rows if r["trainfuse"] and r.get(metric) is not None]
    return (min(theirs, key=lambda r: r[metric]) if theirs else None), (ours[0] if ours else None)


def framework(report: dict) -> str:
    """The training framework a family measured through, with its version ("" if none)."""
    details = report.get("details", {})
    lightning = details.get("lightning")
    ultralytics = details.get("settings", {}).get("ultralytics")
    return lightning or (f"ultralytics {ultralytics}" if ultralytics else "")


def _versions(reports: dict[str, dict]) -> str:
    """The versions line of a GPU's summary: per (torch, triton), the frameworks the families ran
    through and the dates they were measured ("torch 2.11, triton 3.6, ultralytics 8.4.190,
    measured 2026-11-24 to 2026-11-26"); each family's own line is in docs/performance.md.
    Families with no summary row (no headline metric) are left out."""
    combos: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for r in reports.values():
        if r.get("headline"):
            frameworks, dates = combos.setdefault((r["torch"], r["triton"]), (set(), set()))
            frameworks.update({framework(r)} - {""})
            dates.add(r["date"])

    def measured(dates: set[str]) -> str:
        return f"measured {min(dates)}" + (f" to {max(dates)}" if len(dates) > 1 else "")

    return "; ".join(", ".join([f"torch {t}", f"triton {tr}", *sorted(fws), measured(dates)])
                     for (t, tr), (fws, dates) in combos.items())


def _table_head(gpu: str, reports: dict[str, dict], link: str) -> list[str]:
    """The device and versions line of ``reports`` (one GPU's), then the header of a summary table."""
    device = " / ".join(sorted({r["device"] for r in reports.values()}))
    # the commands that made each report head its family's table in docs/performance.md
    return [f"**{device}**: {_versions(reports)}. Data: [`benchmarks/results/{gpu}/`]({link}/{gpu}/).",
            "", "| workload | metric | torch's fastest | trainfuse | speedup |", "|---|---|---|---|---|"]


def _summary_row(report: dict, workload: str, rows: list[dict]) -> str | None:
    """One workload's first trainfuse row against its fastest torch row on the report's headline
    metric (None without a headline metric or without either row)."""
    metric = report.get("headline")
    best, ours = compared(rows, metric) if metric else (None, None)
    if best is None or ours is None:
        return None
    name = "" if ours["impl"] == "trainfuse" else f" ({ours['impl'].removeprefix('trainfuse ')})"
    return (f"| {workload} | {LABELS.get(metric, metric)} | {fmt(metric, best[metric])} ({best['impl']}) | "
            f"{fmt(metric, ours[metric])}{name} | {best[metric] / ours[metric]:.2f}x |")


def summary(results: dict[str, dict[str, dict]], link: str) -> str:
    """The docs' summary block: per GPU, each workload's trainfuse row against torch's fastest."""
    if not results:
        return "No committed results yet.\n"
    parts = []
    for gpu, reports in results.items():
        lines = _table_head(gpu, reports, link)
        for report in reports.values():
            # a sweep's points (``details.summary_skip``) are for the family's table only
            skip = set(report.get("details", {}).get("summary_skip", ()))
            for workload, rows in by_workload(report).items():
                row = None if workload in skip else _summary_row(report, workload, rows)
                if row is not None:
                    lines.append(row)
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def headline(results: dict[str, dict[str, dict]], link: str, gpu: str | None = None,
             picks: tuple[tuple[str, str], ...] | None = None) -> str:
    """The README block: the summary rows of ``picks`` ((family, workload) pairs, default
    :data:`HEADLINE`) on ``gpu`` (default :data:`HEADLINE_GPU`), with the versions of the families
    they come from.

    Raises:
        ValueError: a pick has no summary row in the results (a workload renamed, a file removed).
    """
    gpu = HEADLINE_GPU if gpu is None else gpu
    picks = HEADLINE if picks is None else picks
    reports = results.get(gpu)
    if not reports:
        return "No committed results yet.\n"
    lines = []
    for family, workload in picks:
        report = reports.get(family)
        rows = by_workload(report).get(workload) if report else None
        row = _summary_row(report, workload, rows) if rows else None
        if row is None:
            raise ValueError(f"headline: no summary row for {workload!r} in {gpu}/{family}.json")
        lines.append(row)
    used = {family: reports[family] for family in dict.fromkeys(family for family, _ in picks)}
    return "\n".join(_table_head(gpu, used, link) + lines) + "\n"


def family_table(report: dict) -> str:
    """Every row of one report: its metrics, % of the floor and the ratio to torch's fastest
    (both on the headline metric)."""
    metric = report.get("headline")
    keys = [k for k in report["metrics"] if k != "floor_ms"]
    has_floor = any(r.get("floor_ms") for r in report["rows"])
    header = ["workload", "implementation", *(LABELS.get(k, k) for k in keys)]
    header += ["% floor"] * has_floor + ["vs torch's fastest"] * bool(metric)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, rows in by_workload(report).items():
        best, _ = compared(rows, metric) if metric else (None, None)
        for i, row in enumerate(rows):
            cells = [workload if i == 0 else "", row["impl"], *(fmt(k, row.get(k)) for k in keys)]
            value = row.get(metric) if metric else None
            floor = row.get("floor_ms")
            if has_floor:
                cells.append(f"{floor / value * 100:.0f} %" if value and floor else "")
            if metric:
                cells.append(f"{best[metric] / value:.2f}x" if value and best else "")
            if row["trainfuse"]:
                cells[1] = f"**{cells[1]}**"
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def family_section(family: str, results: dict[str, dict[str, dict]], link: str) -> str:
    """The docs block of one family: per GPU its versions, command, notes, table and PNG."""
    parts = []
    for gpu, reports in results.items():
        report = reports.get(family)
        if report is None:
            continue
        copy = f", copy bandwidth {report['copy_GBps']:.0f} GB/s" if report.get("copy_GBps") else ""
        frame = f", {framework(report)}" if framework(report) else ""
        lines = [f"**{report['device']}**, torch {report['torch']}, triton {report['triton']}{frame}, "
                 f"trainfuse {report['trainfuse']}, measured {report['date']}{copy}: `{report['command']}` "
                 f"([data]({link}/{gpu}/{family}.json)).", ""]
        lines += [f"- {n}" for n in report.get("notes", [])] + [""] * bool(report.get("notes"))
        lines.append(family_table(report))
        lines.append(f"![{family}, {report['device']}]({link}/{gpu}/{family}.png)\n")
        parts.append("\n".join(lines))
    if not parts:
        return (f"No committed results yet: run `python -m trainfuse.bench {family} --out "
                f"benchmarks/results/<gpu>`, then `python benchmarks/render.py`.\n")
    return "\n".join(parts)


def render_text(text: str, results: dict[str, dict[str, dict]], link: str) -> str:
    """``text`` with every marked block replaced by its rendering (``link``: the results folder
    relative to the file)."""
    def block(m: re.Match) -> str:
        name = m.group(1)
        if name == "headline":
            body = headline(results, link)
        elif name == "summary":
            body = summary(results, link)
        else:
            body = family_section(name, results, link)
        return f"<!-- results:{name}:begin -->\n{body}<!-- results:{name}:end -->"

    return MARKER.sub(block, text)


def plot(report: dict, path: Path) -> bool:
    """A bar chart of the headline metric per workload and implementation; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    metric = report["headline"]
    groups = by_workload(report)
    cols = min(len(groups), 3)
    nrows = -(-len(groups) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.axis("off")
    for ax, (workload, rows) in zip(axes.flat, groups.items()):
        rows = [r for r in rows if r.get(metric) is not None]
        values = [r[metric] for r in rows]
        ax.bar(range(len(rows)), values, color=["#d62" if r["trainfuse"] else "#999" for r in rows])
        floor = rows[0].get("floor_ms") if rows else None
        if floor:
            ax.axhline(floor, color="k", ls="--", lw=0.8, label="floor")
        if values and max(values) > 20 * min(values):
            ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), [r["impl"] for r in rows], rotation=60, ha="right", fontsize=6)
        ax.set_title(textwrap.fill(workload, 50), fontsize=7)
        ax.set_ylabel(LABELS.get(metric, metric), fontsize=7)
        ax.tick_params(axis="y", labelsize=6)
    fig.suptitle(f"{report['family']}: {report['device']}, torch {report['torch']}, triton "
                 f"{report['triton']}, {report['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the marked blocks; write nothing")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("files", nargs="*", type=Path, default=TARGETS, help="files with marked blocks")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    stale = []
    for path in args.files:
        text = path.read_text()
        link = Path(os.path.relpath(args.results, path.parent)).as_posix()
        new = render_text(text, results, link)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check:
        for path in stale:
            print(f"{path}: out of date with {args.results}; run python benchmarks/render.py")
        return 1 if stale else 0
    for gpu, reports in results.items():
        for family, report in reports.items():
            png = args.results / gpu / f"{family}.png"
            if not plot(report, png):
                print("matplotlib not installed: no PNGs")
                return 0
            print(f"wrote {png}")
    for path in stale:
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
