"""``python -m trainfuse.bench yolo --default-run``: what a user's clock shows for
``YOLO("yolov5n.yaml").train(data=..., epochs=...)`` with every other argument at its default
(validation every epoch, plots, checkpoints, ``cache=False``, 8 workers), stock against
``FusedDetectionTrainer``, on photo-like JPEGs.

Each run is a fresh process (:func:`one_run`, ``python -m trainfuse.bench.yolo_default``), its wall
clock split into parts by :class:`~trainfuse.bench.timeline.Timeline` (setup, first step, training,
validation, epoch ends, final evaluation). Runs, in this order:

- ``stock``: ultralytics' trainer, the dataset's label caches removed first (as on a new machine);
- ``trainfuse-cold``: ours with empty Triton, inductor and trainfuse caches and no label caches,
  as on a new machine (the kernels trainfuse ships a manifest of compile ahead, the rest in the run);
- ``trainfuse-warm``: ours again, the caches as the cold run left them;
- with ``--stock-warm``, ``stock-warm``: stock again (its label caches there).

``--parallel-plots`` runs ours with ``parallel_plots=True`` (the figures drawn by worker processes),
saved as the family ``yolo-default-run-parallel-plots``. ``--devices 0,1`` trains every run with
``device="0,1"`` (ultralytics' DDP; the default ``batch=16`` is the batch over all GPUs, as a user
running the defaults gets it), the family ``yolo-default-run-2gpus``. Another length than 20 epochs on 2,048
images is a family of its own too (``yolo-default-run-100-epochs-1024-images``).

A long run whose runs do not fit one command's time limit is measured in parts on one machine:
``--runs stock`` first, then ``--runs trainfuse-cold --previous <its partial file>`` in the next
command. Each run records the machine's boot id, and ``--previous`` refuses runs of another
machine or another boot (their timings do not compare).

Machine-wide caches neither trainer owns (matplotlib's font list) are built before the first run.

Goals: the wall clock at least 3x stock's cold and 3.5x warm (4.5x both, from 100 epochs on), the
time to the first step at most stock's plus 5 s cold and plus 1 s warm.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainfuse.bench._common import add_row, note, print_table

GOALS = {"cold_speedup": 3.0, "warm_speedup": 3.5, "first_step_cold_extra_s": 5.0,
         "first_step_warm_extra_s": 1.0}
LONG_EPOCHS, LONG_SPEEDUP = 100, 4.5  # a run this long: both wall-clock goals are this
PARTS = ("setup", "first_step", "train", "validation", "epoch_ends", "final")
PARTIAL = "yolo-default-run.partial.json"  # under --out: the runs finished so far, rewritten after each
RUNS = ("stock", "trainfuse-cold", "trainfuse-warm", "stock-warm")  # in the order they run
DEFAULT_LENGTH = (20, 2048, 512)  # epochs, training images, validation images


def goals_for(epochs: int) -> dict[str, float]:
    """The goals of a run of ``epochs`` epochs."""
    if epochs >= LONG_EPOCHS:
        return {**GOALS, "cold_speedup": LONG_SPEEDUP, "warm_speedup": LONG_SPEEDUP}
    return dict(GOALS)


def _gpus(args) -> int:
    return len(str(getattr(args, "devices", "0")).split(","))


def family_of(args) -> str:
    """The results family of the bench's arguments."""
    name = "yolo-default-run"
    if (args.epochs, args.images, args.val_images) != DEFAULT_LENGTH:
        name += f"-{args.epochs}-epochs-{args.images}-images"
    name += "-parallel-plots" if args.parallel_plots else ""
    return name + (f"-{_gpus(args)}gpus" if _gpus(args) > 1 else "")


def machine_id() -> str:
    """This machine's boot id (a run's timings compare with another's only on the same boot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import platform

        return platform.node()


def planned(args) -> list[str]:
    """The runs ``args`` asks for, in :data:`RUNS`' order."""
    wanted = [r.strip() for r in args.runs.split(",")] if getattr(args, "runs", None) else \
        ["stock", "trainfuse-cold", "trainfuse-warm"] + (["stock-warm"] if args.stock_warm else [])
    unknown = [r for r in wanted if r not in RUNS]
    if unknown or not wanted:
        raise SystemExit(f"yolo --default-run: --runs takes names among {', '.join(RUNS)}, got "
                         f"{args.runs!r}")
    if "trainfuse-warm" in wanted and "trainfuse-cold" not in wanted:
        raise SystemExit("yolo --default-run: trainfuse-warm runs after trainfuse-cold in the same command "
                         "(the compile caches it finds warm are that command's)")
    return [r for r in RUNS if r in wanted]


def previous_runs(path: str | None) -> dict:
    """The runs of an earlier command's partial file (``--previous``), checked to come from this
    machine's boot; {} without one."""
    if not path:
        return {}
    runs = json.loads(Path(path).read_text())
    here = machine_id()
    other = {name: r.get("machine") for name, r in runs.items() if r.get("machine") != here}
    if other:
        raise SystemExit(f"yolo --default-run: --previous {path} holds runs of another machine or boot "
                         f"({other}; this one is {here!r}): their timings do not compare")
    return runs


def one_run(kind: str, data: str, epochs: int, project: str, name: str, seed: int = 0,
            parallel_plots: bool = False, device: str | None = None) -> dict:
    """One default ``train()`` of ``kind`` (``stock`` or ``trainfuse``) in this process: its
    :meth:`~trainfuse.bench.timeline.Timeline.parts`, final mAPs and what it compiled ahead.
    ``device``: ultralytics' ``device=`` (None: its default); several GPUs train under DDP, whose
    rank zero hands its moments back through a file."""
    from ultralytics import YOLO

    from trainfuse.bench.timeline import Timeline

    model = YOLO("yolov5n.yaml")
    shared = Path(project, f"{name}-timeline.json")
    shared.unlink(missing_ok=True)
    timeline = Timeline(share=shared).attach(model)
    kwargs = {"data": data, "epochs": epochs, "project": project, "name": name, "exist_ok": True,
              "seed": seed, **({"device": device} if device else {})}
    if kind == "trainfuse":
        from trainfuse.ultralytics import FusedDetectionTrainer

        kwargs["trainer"] = (functools.partial(FusedDetectionTrainer, parallel_plots=True) if parallel_plots
                             else FusedDetectionTrainer)
    timeline.start()
    model.train(**kwargs)
    timeline.stop()
    metrics = model.trainer.metrics or {}
    return {**timeline.parts(), "map50": metrics.get("metrics/mAP50(B)"),
            "map50_95": metrics.get("metrics/mAP50-95(B)")}


def _spawn(kind: str, data: str, epochs: int, project: Path, name: str, env: dict, seed: int,
           parallel_plots: bool, device: str = "") -> dict:
    result = project / f"{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "trainfuse.bench.yolo_default", kind, data, str(epochs), str(project),
               name, str(seed), str(int(parallel_plots)), device]
    subprocess.run(command, env=env, check=True)
    return json.loads(result.read_text())


def _forget_labels(data: str) -> None:
    for cache in Path(data).parent.glob("labels/*.cache"):
        cache.unlink()


def run(report: dict, args, data: str, out: Path, version: str) -> None:
    """The runs of the module docstring, into ``report``."""
    caches = Path(tempfile.mkdtemp(prefix="trainfuse-default-run-"))  # the caches and run folders, removed
    project = caches / "runs"
    project.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"), "TORCHINDUCTOR_CACHE_DIR":
           str(caches / "inductor"), "TRAINFUSE_CACHE_DIR": str(caches / "trainfuse")}
    runs = previous_runs(getattr(args, "previous", None))
    # (kind, name, label caches removed first)
    plan = [("stock" if name.startswith("stock") else "trainfuse", name, name in ("stock", "trainfuse-cold"))
            for name in planned(args) if name not in runs]
    # machine-wide caches neither trainer owns (matplotlib's font list, built on its first import)
    # are made before the first run, so the stock run does not pay for both
    subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], env=env, check=False)
    try:
        for kind, name, cold in plan:
            if cold:
                _forget_labels(data)
            device = getattr(args, "devices", "") if _gpus(args) > 1 else ""
            runs[name] = _spawn(kind, data, args.epochs, project, name, env, args.seed, args.parallel_plots,
                                device)
            runs[name]["machine"] = machine_id()
            print(f"{name}: {runs[name]['wall']:.1f} s", flush=True)
            # each finished run's parts at once: a bench cut off later (a time limit) keeps them
            out.mkdir(parents=True, exist_ok=True)
            (out / PARTIAL).write_text(json.dumps(runs, indent=1))
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    goals_v = goals_for(args.epochs)
    workload = (f"yolov5n default train(): {args.epochs} epochs, {args.images} photo-like JPEGs, "
                f"{args.val_images} to validate each epoch")
    if args.parallel_plots:
        workload += ", ours with parallel_plots=True"
    if _gpus(args) > 1:
        workload += f", device={args.devices} (DDP, 16 images a step over the {_gpus(args)} GPUs)"
    first = {name: r["setup"] + r["first_step"] for name, r in runs.items()}
    rows = [[name, f"{r['wall']:.1f}", f"{first[name]:.1f}", *(f"{r[p]:.2f}" for p in PARTS),
             "-" if r["map50_95"] is None else f"{r['map50_95']:.3f}"] for name, r in runs.items()]
    print_table(workload, ["run", "wall s", "to first step s", *(f"{p} s" for p in PARTS), "mAP50-95"], rows)
    report["runs"] = runs
    report["settings"] = {"model": "yolov5n.yaml", "epochs": args.epochs, "images": args.images,
                          "val_images": args.val_images, "seed": args.seed, "ultralytics": version,
                          "defaults": "val=True, plots=True, cache=False, workers=8, batch=16, imgsz=640",
                          "parallel_plots": args.parallel_plots, "devices": getattr(args, "devices", "0")}
    ours = [caches for caches in ("cold", "warm") if f"trainfuse-{caches}" in runs]
    if "stock" not in runs or not ours:
        note(report, f"only {', '.join(runs)} ran: the ratios need stock and one of ours (--previous with "
                     f"this command's {PARTIAL} adds the others, run on the same machine)")
        return
    goals, table = {}, []
    for caches in ours:
        stock = runs.get("stock-warm", runs["stock"]) if caches == "warm" else runs["stock"]
        stock_name = "stock-warm" if caches == "warm" and "stock-warm" in runs else "stock"
        ratio = stock["wall"] / runs[f"trainfuse-{caches}"]["wall"]
        extra = first[f"trainfuse-{caches}"] - first[stock_name]
        goals[f"{caches}_speedup"] = ratio >= goals_v[f"{caches}_speedup"]
        goals[f"first_step_{caches}"] = extra <= goals_v[f"first_step_{caches}_extra_s"]
        table += [[f"wall clock, {caches}: stock / ours", f"{ratio:.2f}x",
                   f">= {goals_v[f'{caches}_speedup']}x", goals[f"{caches}_speedup"]],
                  [f"to first step, {caches}: ours - stock", f"{extra:+.1f} s",
                   f"<= +{goals_v[f'first_step_{caches}_extra_s']} s", goals[f"first_step_{caches}"]]]
        for name, r in ((stock_name, stock), (f"trainfuse-{caches}", runs[f"trainfuse-{caches}"])):
            impl = "ultralytics DetectionTrainer" if name.startswith("stock") else "FusedDetectionTrainer"
            add_row(report, f"{workload}: wall clock of train(), {caches} caches", impl,
                    trainfuse=name.startswith("trainfuse"), wall_ms=r["wall"] * 1e3)
    print_table("the user's clock", ["", "value", "goal", "met"], table)
    if "warm" in ours and "stock-warm" not in runs:
        note(report, "the warm ratio divides the stock run's wall clock (label caches removed first): stock "
                     "has no compile caches, and its label cache saves it well under a second")
    if len({r.get("machine") for r in runs.values()}) == 1 and getattr(args, "previous", None):
        note(report, "measured in more than one command, on one machine (the same boot): "
                     + ", ".join(runs))
    report["goals"], report["goal_values"] = goals, goals_v


if __name__ == "__main__":
    kind, data, epochs, project, name, seed, plots, device = sys.argv[1:9]
    result = one_run(kind, data, int(epochs), project, name, int(seed), plots == "1", device or None)
    Path(project, f"{name}.json").write_text(json.dumps(result))
