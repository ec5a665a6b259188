"""parallel_plots: ultralytics' figures drawn by worker processes. A run with them writes the same
files, byte for byte, registered through the same ``on_plot`` names, as the same run drawing them
itself (CPU: the fused optimizer phase with ultralytics' loss trains exactly as stock there)."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import psutil
import pytest

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.utils.plotting import plot_results  # noqa: E402

from trainfuse.ultralytics import FusedDetectionTrainer  # noqa: E402
from trainfuse.ultralytics.plots import WORKER, DeferredPlots, PlotWorkers, framed, read_framed  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402

GAIN = 0.1  # loss gains scaled down: no step clips, so the two runs train identically (test_trainer.py)
FIGURES = (".png", ".jpg")


def test_a_worker_draws_the_figure_ultralytics_draws_and_names_its_file(tmp_path):
    csv = tmp_path / "results.csv"
    csv.write_text("epoch,time,train/box_loss,metrics/mAP50(B),val/box_loss\n1,1.0,0.5,0.1,0.6\n"
                   "2,2.0,0.4,0.2,0.5\n3,3.0,0.3,0.3,0.45\n")
    plot_results(file=csv)
    here = (tmp_path / "results.png").read_bytes()
    (tmp_path / "results.png").unlink()
    names = []
    workers = PlotWorkers(1)
    workers.call("ultralytics.utils.plotting", "plot_results", kwargs={"file": csv}, on_plot=names.append)
    assert names == []  # registered once waited for
    workers.close()
    assert names == [str(tmp_path / "results.png")]
    (drawing, turnaround), = workers.times
    assert 0 < drawing < turnaround
    assert workers.timing() == (f": each {drawing:.1f}-{drawing:.1f} s to draw, {turnaround:.1f}-"
                                f"{turnaround:.1f} s from sent to answered")
    assert PlotWorkers(1).timing() == ""
    assert (tmp_path / "results.png").read_bytes() == here


def test_a_failing_figure_raises_its_error_on_wait_and_the_others_still_register(tmp_path):
    names = []
    workers = PlotWorkers(2)
    workers.ready()
    workers.call("os", "listdir", (str(tmp_path / "absent"),))
    workers.call("pathlib", "Path", (str(tmp_path),), on_plot=names.append)  # no files: nothing named
    with pytest.raises(RuntimeError, match=r"(?s)a figure failed in its worker process \(1 of 2\).*"
                                           r"FileNotFoundError"):
        workers.wait()
    workers.close()  # nothing left to wait for, no worker left running
    assert names == []


def test_a_job_is_answered_while_a_forked_process_holds_the_workers_pipes(tmp_path):
    """A data loader's worker forked after the plot workers started inherits their pipes' ends: the
    job must still reach its worker and the answer come back (read to their lengths, not to the
    ends of the streams, which come only when that process exits)."""
    import multiprocessing
    import time

    workers = PlotWorkers(1)
    workers.ready()
    holder = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    holder.start()
    try:
        names = []
        start = time.perf_counter()
        workers.call("pathlib", "Path", (str(tmp_path),), on_plot=names.append)
        workers.wait()
        assert time.perf_counter() - start < 30  # not held until the forked process ends
    finally:
        holder.kill()
        holder.join()
        workers.close()


def test_framed_messages_are_read_to_their_length():
    read, write = os.pipe()
    try:
        os.write(write, framed(b"abc") + framed(b"") + framed(b"x" * 70000)[:100])
        assert read_framed(read) == b"abc" and read_framed(read) == b""
        os.close(write)
        write = None
        with pytest.raises(EOFError, match="ended after 100 of 70008 bytes"):
            read_framed(read)
    finally:
        os.close(read)
        if write is not None:
            os.close(write)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return str(make_shapes_dataset(tmp_path_factory.mktemp("shapes"), n_train=8, n_val=8, imgsz=64, seed=0))


def _train(data: str, project: Path, trainer=None):
    model = YOLO("yolov5n.yaml")
    model.train(data=data, epochs=1, imgsz=64, batch=4, workers=0, device="cpu", plots=True, val=True,
                seed=0, deterministic=True, verbose=False, optimizer="SGD", box=7.5 * GAIN,
                cls=0.5 * GAIN, dfl=1.5 * GAIN, project=str(project),
                name="stock" if trainer is None else "ours", exist_ok=True,
                **({"trainer": trainer} if trainer else {}))
    return model.trainer


@pytest.mark.cpu_training
def test_a_run_with_parallel_plots_writes_stocks_figures_byte_for_byte(data, tmp_path):
    ours_cls = functools.partial(FusedDetectionTrainer, fused_loss=False, parallel_plots=True)
    stock, ours = _train(data, tmp_path), _train(data, tmp_path, ours_cls)
    figures = {p.name: p for p in Path(stock.save_dir).iterdir() if p.suffix in FIGURES}
    # the labels, four curves and two matrices (drawn twice: the last epoch's validation and the
    # final one), the results, and ultralytics' own drawings of the validation batches
    assert {"labels.jpg", "BoxPR_curve.png", "BoxF1_curve.png", "BoxP_curve.png", "BoxR_curve.png",
            "confusion_matrix.png", "confusion_matrix_normalized.png", "results.png"} <= figures.keys()
    assert {p.name for p in Path(ours.save_dir).iterdir() if p.suffix in FIGURES} == figures.keys()
    # drawn by the workers: the labels, then the curves and matrices of both validations
    drawn = [Path(f).name for f in ours.plotted_in_workers]
    matrices = ["confusion_matrix_normalized.png", "confusion_matrix.png"]
    curves = ["BoxPR_curve.png", "BoxF1_curve.png", "BoxP_curve.png", "BoxR_curve.png"]
    assert drawn == ["labels.jpg", *curves, *matrices, *curves, *matrices]
    assert isinstance(ours.validator, DeferredPlots)
    assert type(ours.validator).__name__ == "FusedDetectionValidator"  # as reports and logs name it
    rows = {r.kind: r for r in ours.report}
    assert rows["validator"].name == "FusedDetectionValidator"
    for name, path in figures.items():
        assert (Path(ours.save_dir) / name).read_bytes() == path.read_bytes(), name
    assert {p.name for p in ours.plots} == {p.name for p in stock.plots}
    assert {p.name for p in ours.validator.plots} == {p.name for p in stock.validator.plots}
    workers = [p for p in psutil.Process().children(recursive=True) if WORKER in " ".join(p.cmdline())]
    assert workers == []  # stopped before train() returned
    assert ours.metrics == stock.metrics
