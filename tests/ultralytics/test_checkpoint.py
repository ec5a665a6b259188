"""CheckpointWriter (trainfuse/ultralytics/checkpoint.py): ultralytics' checkpoints, written in the
background and atomically.

The contents are compared with what ultralytics' own ``BaseTrainer.save_model`` writes from the very
same state: on a small trainer-shaped object (NaN/Inf in the EMA, channels_last weights, fp16
overflow, SGD and the fused AdamW), and at every epoch of a real tiny run of FusedDetectionTrainer
(the stock save then made on the run's trainer, into a folder of its own). Every entry but ``date``
and ``git`` must be equal, tensors bit for bit with their dtype and strides. A writer process killed
with SIGKILL at random moments must leave a complete last.pt; a resume from the writer's last.pt must
continue the run.
"""

from __future__ import annotations

import copy
import io
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.engine.trainer import BaseTrainer  # noqa: E402
from ultralytics.utils.torch_utils import ModelEMA  # noqa: E402

import trainfuse  # noqa: E402
from tests._helpers import cuda  # noqa: E402
from trainfuse.ultralytics import FusedDetectionTrainer, checkpoint  # noqa: E402
from trainfuse.ultralytics.changes.optimizer import TorchLayoutOptimizer  # noqa: E402
from trainfuse.ultralytics.checkpoint import PARTIAL_SUFFIX, CheckpointWriteError, CheckpointWriter  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402

STOCK_ONLY = {"date", "git"}  # the time of the save and the repository it ran from


def assert_same(ours, stock, where: str = "checkpoint") -> None:
    """``ours`` equals ``stock``: the same keys and types all the way down, tensors bit for bit (NaN
    where NaN) with the same dtype, shape, strides and device, modules by type, state and public
    attributes."""
    if isinstance(stock, torch.Tensor):
        assert isinstance(ours, torch.Tensor), where
        assert (ours.dtype, ours.shape, ours.stride(), ours.device) == \
            (stock.dtype, stock.shape, stock.stride(), stock.device), where
        torch.testing.assert_close(ours, stock, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(stock, nn.Module):
        assert [type(m) for m in ours.modules()] == [type(m) for m in stock.modules()], where
        assert_same(ours.state_dict(), stock.state_dict(), f"{where}.state_dict()")
        public = {k: v for k, v in vars(stock).items() if not k.startswith("_")}
        assert_same({k: v for k, v in vars(ours).items() if not k.startswith("_")}, public, where)
    elif isinstance(stock, dict):
        assert isinstance(ours, dict) and list(ours) == list(stock), f"{where}: {list(ours)} != {list(stock)}"
        for k in stock:
            assert_same(ours[k], stock[k], f"{where}[{k!r}]")
    elif isinstance(stock, (list, tuple)):
        assert type(ours) is type(stock) and len(ours) == len(stock), where
        for i, (a, b) in enumerate(zip(ours, stock)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(stock, float) and math.isnan(stock):
        assert isinstance(ours, float) and math.isnan(ours), where
    else:
        assert type(ours) is type(stock) and ours == stock, f"{where}: {ours!r} != {stock!r}"


def assert_same_checkpoint_files(ours: Path, stock: Path) -> None:
    a, b = (torch.load(p, map_location="cpu", weights_only=False) for p in (ours, stock))
    assert list(a) == list(b)
    assert_same({k: v for k, v in a.items() if k not in STOCK_ONLY},
                {k: v for k, v in b.items() if k not in STOCK_ONLY}, ours.name)


# ---- the writer ---------------------------------------------------------------------------------------
def test_every_path_gets_the_same_bytes_and_no_partial_file_is_left(tmp_path):
    writer = CheckpointWriter()
    paths = [tmp_path / "weights" / name for name in ("last.pt", "best.pt", "epoch3.pt")]
    writer.write(lambda: b"first", paths[:1])
    writer.write(lambda: b"second", paths)
    writer.close()
    assert [p.read_bytes() for p in paths] == [b"second"] * 3
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["best.pt", "epoch3.pt", "last.pt"]
    assert not any(t.name.startswith("trainfuse-checkpoint") for t in threading.enumerate())


def test_a_write_waits_for_the_one_in_flight(tmp_path):
    writer = CheckpointWriter()
    release, started = threading.Event(), []

    def slow() -> bytes:
        started.append("first")
        assert release.wait(10)
        return b"first"

    writer.write(slow, [tmp_path / "last.pt"])
    second = threading.Thread(target=writer.write, args=(lambda: started.append("second") or b"second",
                                                         [tmp_path / "last.pt"]))
    second.start()
    second.join(0.3)
    assert second.is_alive() and started == ["first"]  # held back while the first is in flight
    release.set()
    second.join(10)
    assert not second.is_alive()
    writer.close()
    assert started == ["first", "second"] and (tmp_path / "last.pt").read_bytes() == b"second"


def test_a_failed_write_raises_on_the_flushing_thread_and_keeps_the_previous_file(tmp_path, monkeypatch):
    writer = CheckpointWriter()
    last = tmp_path / "last.pt"
    writer.write(lambda: b"good", [last])
    writer.flush()

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_atomically", full_disk)
    writer.write(lambda: b"new", [last])
    with pytest.raises(CheckpointWriteError, match=r"writing .*last\.pt in the background failed with "
                                                   r"OSError: \[Errno 28\] No space left on device") as info:
        writer.flush()
    assert isinstance(info.value.__cause__, OSError)
    writer.flush()  # raised once
    writer.close()
    assert last.read_bytes() == b"good" and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_a_serialize_error_surfaces_at_the_next_write(tmp_path):
    writer = CheckpointWriter()
    writer.write(lambda: 1 / 0, [tmp_path / "last.pt"])
    with pytest.raises(CheckpointWriteError, match="ZeroDivisionError"):
        writer.write(lambda: b"next", [tmp_path / "last.pt"])
    writer.close(raise_error=False)
    assert not (tmp_path / "last.pt").exists()


PAYLOAD = 8 * 2**20  # float32 elements: a 32 MiB checkpoint, written twice per save


def _write_until_killed(folder: Path, base: torch.Tensor, started: int) -> None:
    """A child process's loop: checkpoint ``i`` holds ``base`` and ``i`` in a small tensor; one byte
    to ``started`` once the first is on disk."""
    writer = CheckpointWriter()
    for i in range(10**6):
        buffer = io.BytesIO()
        torch.save({"i": i, "base": base, "tail": torch.full((16,), i)}, buffer)
        data = buffer.getvalue()
        writer.write(lambda data=data: data, [folder / "last.pt", folder / "best.pt"])
        if i == 1:  # the write of 0 has landed (a write waits for the previous one)
            os.write(started, b"1")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the writing process")
def test_a_process_killed_at_any_moment_leaves_a_complete_checkpoint(tmp_path):
    base = torch.arange(PAYLOAD, dtype=torch.float32)
    delays = (torch.rand(5) * 0.3).tolist()  # seconds after the first checkpoint landed
    killed_mid_write = 0
    for round_, delay in enumerate(delays):
        folder = tmp_path / f"round{round_}"
        folder.mkdir()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no test machinery, no intra-op threads (forked from a threaded process)
            try:
                torch.set_num_threads(1)
                os.close(read)
                _write_until_killed(folder, base, write)
            finally:
                os._exit(1)
        os.close(write)
        try:
            assert os.read(read, 1) == b"1"
            time.sleep(delay)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
        killed_mid_write += any(folder.glob(f"*{PARTIAL_SUFFIX}"))
        for name in ("last.pt", "best.pt"):
            ckpt = torch.load(folder / name, weights_only=True)
            assert ckpt["i"] >= 0 and torch.equal(ckpt["tail"], torch.full((16,), ckpt["i"])), (round_, name)
            assert torch.equal(ckpt["base"], base), (round_, name)
    # the writes of 64 MiB fill most of the child's time: kills land inside them
    assert killed_mid_write > 0, f"no kill of {delays} landed inside a write"


# ---- the snapshot against stock's save_model, from the same state ----------------------------------------
class _Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 4, 1))
        self.criterion = {"box": 7.5}  # training-only state: stock drops it from its copy
        self.names = {0: "a", 1: "b"}


def _trainer_like(folder: Path, device: torch.device, optimizer: str) -> SimpleNamespace:
    """What ``BaseTrainer.save_model`` reads of a trainer, for a small channels_last model trained
    two steps."""
    model = _Net().to(device).to(memory_format=torch.channels_last)
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if optimizer == "SGD"
           else trainfuse.FusedAdamW(model.parameters(), lr=0.01))
    ema = ModelEMA(model)
    for _ in range(2):
        model(torch.randn(2, 3, 8, 8, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
    csv = folder.parent / f"{folder.name}-results.csv"  # beside the weights folder, as ultralytics keeps it
    csv.parent.mkdir(parents=True, exist_ok=True)
    csv.write_text("epoch,time,metrics/mAP50(B)\n1,2.5,0.125\n2,5.25,0.5\n")
    trainer = SimpleNamespace(
        ema=ema, model=model, optimizer=opt, scaler=torch.amp.GradScaler(device.type, enabled=False),
        device=device, epoch=3, best_fitness=0.25, fitness=0.25, metrics={"metrics/mAP50(B)": 0.5},
        stopper=SimpleNamespace(best_fitness=0.25, best_epoch=3), args=SimpleNamespace(lr0=0.01, epochs=9),
        csv=csv, save_period=3, callbacks={"on_model_save": []},
        wdir=folder, last=folder / "last.pt", best=folder / "best.pt")
    trainer.read_results_csv = lambda: BaseTrainer.read_results_csv(trainer)  # stock's read of the csv
    return trainer


def _poison(trainer: SimpleNamespace) -> None:
    """NaN in an EMA weight (the model's is finite: stock copies it back), Inf in an EMA buffer and
    in the model's (left to the clamp), a value fp16 overflows."""
    ema = trainer.ema.ema
    ema[0].weight.data[0, 0, 0, 0] = math.nan
    ema[1].running_var.data[1] = math.inf
    trainer.model[1].running_var.data[1] = -math.inf
    ema[3].bias.data[2] = 1e6


def _stock_save(trainer: SimpleNamespace, folder: Path) -> SimpleNamespace:
    """``trainer`` after ultralytics' own save_model into ``folder``."""
    trainer.wdir, trainer.last, trainer.best = folder, folder / "last.pt", folder / "best.pt"
    optimizer = trainer.optimizer
    if isinstance(optimizer, trainfuse.FusedAdamW):  # as FusedDetectionTrainer hands it to stock
        trainer.optimizer = TorchLayoutOptimizer(optimizer)
    assert BaseTrainer.save_model(trainer)
    trainer.optimizer = optimizer
    return trainer


@pytest.mark.parametrize("optimizer", ["SGD", "FusedAdamW"])
@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nan-inf"])
def test_the_checkpoint_is_stocks_and_the_ema_is_resynced_as_stock_does(tmp_path, device, optimizer,
                                                                         poisoned):
    ours = _trainer_like(tmp_path / "ours", device, optimizer)
    if poisoned:
        _poison(ours)
    stock = _stock_save(copy.deepcopy(ours), tmp_path / "stock")
    writer = CheckpointWriter()
    assert writer.save(ours, torch_layout=optimizer == "FusedAdamW")
    writer.close()
    assert sorted(p.name for p in ours.wdir.iterdir()) == sorted(p.name for p in stock.wdir.iterdir()) == \
        ["best.pt", "epoch3.pt", "last.pt"]
    for name in ("best.pt", "epoch3.pt", "last.pt"):
        assert_same_checkpoint_files(ours.wdir / name, stock.wdir / name)
    assert_same(ours.ema.ema.state_dict(), stock.ema.ema.state_dict(), "the live EMA")
    saved = torch.load(ours.last, weights_only=False)["ema"]
    assert saved.criterion is None and next(saved.parameters()).dtype == torch.float16
    if poisoned:
        assert torch.isfinite(saved[0].weight).all() and saved[3].bias[2] == torch.finfo(torch.float16).max


def test_the_checkpoint_is_the_state_at_the_save_not_after_later_steps(tmp_path, device):
    trainer = _trainer_like(tmp_path / "ours", device, "SGD")
    expected = _stock_save(copy.deepcopy(trainer), tmp_path / "stock")
    writer = CheckpointWriter()
    assert writer.save(trainer)
    for p in trainer.ema.ema.state_dict().values():  # the next steps change the live tensors in place
        p.add_(1)
    for state in trainer.optimizer.state.values():
        state["momentum_buffer"].mul_(-3)
    trainer.args.epochs, trainer.metrics["metrics/mAP50(B)"] = 99, 0.0
    writer.close()
    assert_same_checkpoint_files(trainer.last, expected.last)


class _CopiedWhere:
    """Notes the thread that deep-copies it."""

    def __init__(self):
        self.threads: list[threading.Thread] = []

    def __deepcopy__(self, memo):
        self.threads.append(threading.current_thread())
        return _CopiedWhere()


def test_the_ema_structure_is_copied_off_the_calling_thread_as_it_was_at_the_save(tmp_path, device):
    trainer = _trainer_like(tmp_path / "ours", device, "SGD")
    trainer.ema.ema.probe = probe = _CopiedWhere()
    writer = CheckpointWriter()
    assert writer.save(trainer)
    writer.wait_copied()
    assert len(probe.threads) == 1 and probe.threads[0] is not threading.current_thread()
    trainer.ema.ema.names = {0: "changed"}  # ultralytics' update_attr at the next epoch's end
    writer.close()
    saved = torch.load(trainer.last, weights_only=False)["ema"]
    assert saved.names == {0: "a", 1: "b"} and isinstance(saved.probe, _CopiedWhere)


def test_a_device_without_a_snapshot_is_saved_by_the_caller_with_the_reason_logged(tmp_path, caplog):
    trainer = _trainer_like(tmp_path, torch.device("cpu"), "SGD")
    trainer.device = torch.device("meta")
    writer = CheckpointWriter()
    from ultralytics.utils import LOGGER

    LOGGER.addHandler(caplog.handler)
    try:
        assert not writer.save(trainer) and not writer.save(trainer)
    finally:
        LOGGER.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "checkpoints written by ultralytics" in r.getMessage()]
    assert len(lines) == 1 and "the run is on meta" in lines[0]  # once, with why
    assert not trainer.last.exists()


@cuda
def test_on_cuda_the_snapshot_syncs_the_host_once(tmp_path):
    import warnings

    trainer = _trainer_like(tmp_path, torch.device("cuda"), "FusedAdamW")
    writer = CheckpointWriter()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert writer.save(trainer, torch_layout=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    writer.close()
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]  # the EMA's NaN/Inf check


def _slow_writes(monkeypatch, seconds: float = 0.3) -> None:
    write = checkpoint.write_atomically

    def slow(path, data):
        time.sleep(seconds)
        write(path, data)

    monkeypatch.setattr(checkpoint, "write_atomically", slow)


def test_save_returns_before_the_write_unless_a_users_callback_reads_the_files(tmp_path, monkeypatch):
    from ultralytics.utils.callbacks import base

    _slow_writes(monkeypatch)
    trainer = _trainer_like(tmp_path, torch.device("cpu"), "SGD")
    trainer.callbacks["on_model_save"] = [base.on_model_save]  # ultralytics' own reads nothing
    writer = CheckpointWriter()
    assert writer.save(trainer)
    assert not trainer.last.exists()  # in flight
    writer.flush()
    trainer.epoch = 4

    def timer(t):  # reads no file, and says so
        pass

    timer.reads_checkpoint = False
    trainer.callbacks["on_model_save"].append(timer)
    assert writer.save(trainer)
    assert torch.load(trainer.last, weights_only=False)["epoch"] == 3  # epoch 4's still in flight
    writer.flush()
    trainer.epoch = 5
    trainer.callbacks["on_model_save"].append(lambda t: None)  # ultralytics calls it once the files are saved
    assert writer.save(trainer)
    assert torch.load(trainer.last, weights_only=False)["epoch"] == 5
    writer.close()


# ---- whole runs ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("shapes")
    return str(make_shapes_dataset(root, n_train=16, n_val=8, imgsz=64, seed=0))


TRAIN = dict(epochs=2, imgsz=64, batch=4, nbs=8, workers=0, device="cpu", plots=False, val=False, seed=0,
             deterministic=True, verbose=False, exist_ok=True, trainer=FusedDetectionTrainer)


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """FusedDetectionTrainer with AdamW for 2 epochs (best.pt and epochN.pt at every epoch); after each
    epoch's save, its files as the writer wrote them, and as ultralytics' own save_model writes
    them from the same state, in ``<project>/{ours,stock}/epoch<N>``."""
    project = tmp_path_factory.mktemp("checkpoint-run")
    model = YOLO("yolov5n.yaml")

    def keep_both(trainer):
        if trainer.epoch >= trainer.epochs:  # final_eval's report of the best model
            return
        trainer.checkpoints.flush()
        ours, stock = (project / side / f"epoch{trainer.epoch}" for side in ("ours", "stock"))
        ours.mkdir(parents=True)
        for path in checkpoint.targets(trainer):
            shutil.copyfile(path, ours / path.name)
        wdir, last, best = trainer.wdir, trainer.last, trainer.best
        trainer.wdir, trainer.last, trainer.best = stock, stock / "last.pt", stock / "best.pt"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CheckpointWriter, "save", lambda *args, **kwargs: False)  # the stock path
            trainer.save_model()
        trainer.wdir, trainer.last, trainer.best = wdir, last, best

    model.add_callback("on_fit_epoch_end", keep_both)
    model.train(data=data, optimizer="AdamW", save_period=1, project=str(project), name="run", **TRAIN)
    return SimpleNamespace(model=model, project=project)


@pytest.mark.cpu_training
def test_the_runs_checkpoints_are_ultralytics_own(run):
    for epoch in (0, 1):
        ours, stock = (run.project / side / f"epoch{epoch}" for side in ("ours", "stock"))
        names = sorted(p.name for p in ours.iterdir())
        assert names == sorted(p.name for p in stock.iterdir()) == ["best.pt", f"epoch{epoch}.pt", "last.pt"]
        for name in names:
            assert_same_checkpoint_files(ours / name, stock / name)
    ckpt = torch.load(run.project / "ours" / "epoch0" / "last.pt", weights_only=False)
    assert ckpt["optimizer"]["param_groups"][0]["param_group"] == "weight"
    assert isinstance(run.model.trainer.optimizer, trainfuse.FusedAdamW)


@pytest.mark.cpu_training
def test_a_resume_from_the_writers_last_pt_continues_and_ends_with_stripped_files(run, tmp_path, monkeypatch):
    ckpt = tmp_path / "last.pt"
    shutil.copyfile(run.project / "ours" / "epoch0" / "last.pt", ckpt)
    _slow_writes(monkeypatch)  # the last save is still in flight when final_eval reads the files
    model = YOLO(str(ckpt))
    losses = []
    model.add_callback("on_train_batch_end", lambda t: losses.append(float(t.loss.detach())))
    model.train(resume=True, save_dir=str(tmp_path / "resumed"), trainer=FusedDetectionTrainer)
    trainer = model.trainer
    assert trainer.start_epoch == 1 and len(losses) == 4 and all(map(math.isfinite, losses))
    assert trainer.ema.updates == 5  # 3 steps in epoch 0, 2 in epoch 1 (warmup's accumulation)
    for path in (trainer.last, trainer.best):  # final_eval stripped them after the writer's last write
        final = torch.load(path, weights_only=False)
        assert final["optimizer"] is None and final["epoch"] == -1, path
    assert not any(t.name.startswith("trainfuse-checkpoint") for t in threading.enumerate())


@pytest.mark.cpu_training
def test_a_failed_write_stops_training_with_its_error(data, tmp_path, monkeypatch):
    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_atomically", full_disk)
    epochs = []
    model = YOLO("yolov5n.yaml")
    model.add_callback("on_train_epoch_start", lambda t: epochs.append(t.epoch))
    with pytest.raises(CheckpointWriteError, match=r"writing .*last\.pt.* failed with OSError: .*No space"):
        model.train(data=data, project=str(tmp_path), name="full", **TRAIN)
    assert epochs == [0, 1]  # raised at the end of the epoch after the failed save, before its own
    assert not any(t.name.startswith("trainfuse-checkpoint") for t in threading.enumerate())
