"""FusedDetectionTrainer under ultralytics' own DDP (``device="0,1"``; 2 GPUs, NCCL).

ultralytics launches the ranks itself (``torch.distributed.run`` over a pickled trainer), so what
each rank did comes back through a callback that writes a file per rank (:class:`RankRecord`). The
graphed run (replays, then one flat all-reduce per optimizer step) is compared with the same
trainer run eagerly under DDP's reducer (an all-reduce per backward), over 100 iterations of SGD,
whose update scales with the grads (a wrong factor in the reduction shows; Adam would hide it).
Once the accumulation ramps up the two add the micro-batches in another order, so they agree to
float32 rounding grown over the run; every rank holds the same weights bit for bit.

Resume across rank counts: a run of the fused trainer interrupted after two epochs of three, saved on
2 GPUs or on 1, resumes on 2 or on 1 (``YOLO(last.pt).train(resume=True, device=...)``, ultralytics'
own path: ``device`` is one of the arguments a resume may change). Its checkpoints must stay stock
(no trainfuse class in the pickle, torch.optim's optimizer layout), and the resume must continue
the run: the next epoch, the optimizer, EMA and GradScaler state as saved. Stock ultralytics
resumes the same checkpoints the same way.
"""

from __future__ import annotations

import csv
import json
import math
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.nn.tasks import DetectionModel  # noqa: E402
from ultralytics.utils.torch_utils import unwrap_model  # noqa: E402

from trainfuse.ultralytics import FusedDetectionTrainer  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


class EagerTrainer(FusedDetectionTrainer):
    """The fused trainer without graphs: under DDP the choice must be the class's (the ranks
    rebuild the trainer from its class)."""

    cuda_graphs = False


class RankRecord:
    """Each rank's losses, report and final weights, written to ``<out>/<name>-rank<r>`` after the
    last epoch (``on_train_end`` runs on rank zero only: it adds the graphs' counts)."""

    def __init__(self, out: str, name: str, snapshots: int = 3) -> None:
        self.out, self.name, self.losses, self.snapshots = out, name, [], snapshots
        self.weights: list[torch.Tensor] = []  # all params, flat: at the start, after the first iterations

    def attach(self, model) -> RankRecord:
        model.add_callback("on_train_start", self.snapshot)
        model.add_callback("on_train_batch_end", self.on_train_batch_end)
        model.add_callback("on_fit_epoch_end", self.on_fit_epoch_end)
        model.add_callback("on_train_end", self.on_train_end)
        return self

    def snapshot(self, trainer) -> None:
        if len(self.weights) < self.snapshots:
            params = unwrap_model(trainer.model).parameters()
            self.weights.append(torch.cat([p.detach().float().reshape(-1).cpu() for p in params]))

    def on_train_batch_end(self, trainer) -> None:
        self.losses.append(float(trainer.loss.detach()))
        self.snapshot(trainer)

    def on_fit_epoch_end(self, trainer) -> None:
        if trainer.epoch + 1 < trainer.epochs:
            return
        rank = int(os.environ.get("RANK", "0"))
        info = {"losses": self.losses, "world_size": trainer.world_size,
                "graphs_reason": getattr(trainer, "graphs_reason", None),
                "report": [[r.kind, r.action] for r in getattr(trainer, "report", ())],
                "optimizer": type(trainer.optimizer).__name__}
        base = os.path.join(self.out, f"{self.name}-rank{rank}")
        Path(base + ".json").write_text(json.dumps(info))
        state = {k: v.detach().float().cpu() for k, v in unwrap_model(trainer.model).state_dict().items()}
        torch.save({"state": state, "weights": self.weights}, base + ".pt")

    def on_train_end(self, trainer) -> None:
        stats = getattr(trainer, "graph_stats", None)
        replays = None if stats is None else stats.replays
        Path(os.path.join(self.out, f"{self.name}-stats.json")).write_text(json.dumps({"replays": replays}))


def _ddp_run(trainer, data: str, project: Path, name: str, model: str = "yolov5n.yaml",
             epochs: int = 20, **kw) -> list[tuple[dict, dict]]:
    model = YOLO(model)
    RankRecord(str(project), name).attach(model)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off
    model.train(data=data, epochs=epochs, imgsz=64, batch=8, nbs=16, workers=0, device="0,1", plots=False,
                val=False, seed=0, deterministic=True, verbose=False, project=str(project), name=name,
                exist_ok=True, optimizer="SGD", lr0=0.02, trainer=trainer, **kw)
    ranks = [(json.loads((project / f"{name}-rank{r}.json").read_text()),
              torch.load(project / f"{name}-rank{r}.pt")) for r in range(2)]
    ranks[0][0].update(json.loads((project / f"{name}-stats.json").read_text()))
    return ranks


@two_gpus
def test_ddp_with_graphs_trains_as_eager_ddp_and_keeps_the_ranks_equal(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes-ddp")
    data = str(make_shapes_dataset(root, n_train=40, n_val=8, imgsz=64, seed=1))
    project = tmp_path_factory.mktemp("runs-ddp")
    graphed = _ddp_run(FusedDetectionTrainer, data, project, "graphed")
    eager = _ddp_run(EagerTrainer, data, project, "eager")
    (g0, gw0), (g1, gw1) = graphed
    (e0, ew0), (e1, ew1) = eager
    assert g0["world_size"] == e0["world_size"] == 2
    assert g0["optimizer"] == e0["optimizer"] == "FusedSGD"
    assert g0["graphs_reason"] == "" and e0["graphs_reason"] == "cuda_graphs=False"
    assert ["ddp", "swapped"] in g0["report"] and ["casts", "skipped"] in g0["report"]
    # the class's default: each rank decodes and augments its JPEGs (read from disk) on its own GPU
    assert all(["augment", "on"] in r["report"] for r in (g0, g1, e0, e1))
    assert g0["replays"] >= 80, g0["replays"]  # 5 iterations an epoch, 20 epochs, 100 in all
    assert len(g0["losses"]) == len(e0["losses"]) == 100
    for k in gw0["state"]:  # every rank the same weights (BatchNorm's statistics are per rank, as in DDP)
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(gw0["state"][k], gw1["state"][k]), k
            assert torch.equal(ew0["state"][k], ew1["state"][k]), k
    # the first steps (warmup: one micro-batch a step) move the weights as DDP moves them: the same
    # grads of loss * world_size (the same overflows, so the same skipped steps), the same average
    (a0, *a), (b0, *b) = gw0["weights"], ew0["weights"]
    assert torch.equal(a0, b0) and len(a) == len(b) == 2
    for k, (ak, bk) in enumerate(zip(a, b)):
        ours, ddp = ak - a0, bk - b0  # the update of the first k + 1 steps
        err = float((ours - ddp).abs().max())
        assert err <= 1e-3 * float(ddp.abs().max()), (k, err, float(ddp.abs().max()))
    assert g0["losses"][:3] == pytest.approx(e0["losses"][:3], rel=1e-4)
    # after that the two drift apart as any two runs whose sums round differently (the loss of this
    # tiny set moves by tens of % between such runs): the bench's 30 epochs compare the quality
    losses = {"graphs": g0["losses"], "eager DDP": e0["losses"]}
    assert all(math.isfinite(x) for run in losses.values() for x in run), losses
    assert g1["losses"] != g0["losses"]  # the ranks saw other images


@two_gpus
@pytest.mark.parametrize("task,model", [("segment", "yolo11n-seg.yaml"), ("pose", "yolo11n-pose.yaml"),
                                        ("obb", "yolo11n-obb.yaml"), ("classify", "yolo11n-cls.yaml")])
def test_each_tasks_trainer_trains_under_ddp_from_graphs_with_the_ranks_equal(tmp_path_factory, task, model):
    """Every task's fused trainer with ``device="0,1"`` (the class's defaults: its fused loss, graphs,
    the optimizer phase inside them): the step replays on both ranks, the grads are averaged (every
    rank ends with the same weights) and the loss stays finite."""
    from trainfuse.ultralytics import trainer_for
    from trainfuse.ultralytics.task_shapes import make_task_dataset

    root = tmp_path_factory.mktemp(f"{task}-ddp")
    data = str(make_task_dataset(root, task, n_train=40, n_val=8, imgsz=64, seed=1, max_objects=4))
    project = tmp_path_factory.mktemp(f"{task}-runs-ddp")
    trainer = trainer_for(YOLO(model))
    (r0, w0), (r1, w1) = _ddp_run(trainer, data, project, task, model=model, epochs=4)
    assert r0["world_size"] == 2 and r0["graphs_reason"] == "", r0
    assert r0["optimizer"] == "FusedSGD" and ["ddp", "swapped"] in r0["report"]
    assert r0["replays"] >= 10, r0["replays"]  # 5 iterations an epoch, the first of each shape eager
    assert len(r0["losses"]) == len(r1["losses"]) == 20
    assert all(math.isfinite(x) for x in r0["losses"] + r1["losses"])
    for k in w0["state"]:
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(w0["state"][k], w1["state"][k]), k


@two_gpus
def test_batch_below_one_is_refused_under_ddp_as_stock_refuses_it(tmp_path):
    data = str(make_shapes_dataset(tmp_path / "d", n_train=8, n_val=4, imgsz=64, seed=0))
    for trainer in (None, FusedDetectionTrainer):
        with pytest.raises(ValueError, match="AutoBatch with batch<1 not supported for Multi-GPU"):
            YOLO("yolov5n.yaml").train(data=data, epochs=1, imgsz=64, batch=-1, device="0,1", plots=False,
                                       project=str(tmp_path), name="auto", exist_ok=True,
                                       **({"trainer": trainer} if trainer else {}))


# ---- resume across rank counts -----------------------------------------------------------------
RESUME_EPOCHS = 3  # the interrupted runs train the first two, the resume the third
RESUME_ITERATIONS = 5  # an epoch: 40 images, batch 8 (4 a rank under DDP)


class ResumeRecord:
    """What each rank of a resumed run started from and did, written to ``<out>/<name>-rank<r>.pt``.

    ``on_train_start`` (every rank, after ``resume_training``, before the first step) keeps what the
    resume put in place: the start epoch, each param's optimizer ``step`` and ``exp_avg``, the EMA's
    update count, the GradScaler's state and which classes hold them; the last epoch's
    ``on_fit_epoch_end`` (every rank) adds the losses and the weights."""

    def __init__(self, out: str, name: str) -> None:
        self.out, self.name, self.losses, self.start = out, name, [], {}

    def attach(self, model) -> ResumeRecord:
        model.add_callback("on_train_start", self.on_train_start)
        model.add_callback("on_train_batch_end", self.on_train_batch_end)
        model.add_callback("on_fit_epoch_end", self.on_fit_epoch_end)
        return self

    def on_train_start(self, trainer) -> None:
        state = trainer.optimizer.state_dict()["state"]
        scaler = type(trainer.scaler)
        self.start = {"start_epoch": trainer.start_epoch, "epochs": trainer.epochs,
                      "world_size": trainer.world_size, "optimizer": type(trainer.optimizer).__name__,
                      "ema": type(trainer.ema).__name__, "updates": trainer.ema.updates,
                      "scaler_class": f"{scaler.__module__}.{scaler.__name__}",
                      "scaler": trainer.scaler.state_dict(),
                      "state": {i: {k: s[k].detach().float().cpu().clone() for k in ("step", "exp_avg")}
                                for i, s in state.items() if "step" in s}}  # the params trained so far

    def on_train_batch_end(self, trainer) -> None:
        self.losses.append(float(trainer.loss.detach()))

    def on_fit_epoch_end(self, trainer) -> None:
        if trainer.epoch + 1 != trainer.epochs:  # the last epoch (final_eval calls it once more, one past)
            return
        rank = int(os.environ.get("RANK", "0"))
        weights = {k: v.detach().float().cpu() for k, v in unwrap_model(trainer.model).state_dict().items()}
        torch.save({**self.start, "losses": self.losses, "tloss": [float(v) for v in trainer.tloss.values()],
                    "graphs_reason": getattr(trainer, "graphs_reason", None), "weights": weights,
                    "report": [[r.kind, r.action] for r in getattr(trainer, "report", ())]},
                   os.path.join(self.out, f"{self.name}-rank{rank}.pt"))


def _interrupted_run(data: str, project: Path, device: str) -> Path:
    """The first two epochs of a run of FusedDetectionTrainer on ``device``, with a checkpoint after
    each (``save_period=1``); returns its folder. Its ``weights/epoch1.pt`` is what ``last.pt`` held
    after the second epoch: ultralytics strips the finished run's ``last.pt`` (no optimizer, epoch
    -1) in ``final_eval``, so that it cannot be resumed."""
    name = "saved-on-" + device.replace(",", "-")
    model = YOLO("yolov5n.yaml")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off
    model.train(data=data, epochs=RESUME_EPOCHS - 1, save_period=1, imgsz=64, batch=8, nbs=16, workers=0,
                device=device, plots=False, val=False, seed=0, deterministic=True, verbose=False,
                project=str(project), name=name, exist_ok=True, optimizer="AdamW", lr0=0.002,
                trainer=FusedDetectionTrainer)
    return Path(model.trainer.save_dir)


def _pickled_globals(path: Path) -> set[str]:
    """Every class and function the pickle of checkpoint ``path`` names (``module.name``): what
    loading it imports."""
    names: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            names.add(f"{module}.{name}")
            return super().find_class(module, name)

    torch.load(path, map_location="cpu", weights_only=False,
               pickle_module=SimpleNamespace(__name__="pickle", Unpickler=Recording, load=pickle.load))
    return names


def _stock_checkpoint(path: Path) -> dict:
    """Checkpoint ``path`` loaded as a user loads it (``torch.load``, ``weights_only=False``), once
    checked to be ultralytics' own: no class of trainfuse in its pickle (it loads where trainfuse is
    not installed; no fused EMA, loss, optimizer or scaler left in it), ultralytics' keys, the model a
    plain DetectionModel without a criterion and, mid-run, the optimizer state in the layout of
    torch.optim.AdamW (no float32 masters)."""
    ours = sorted(n for n in _pickled_globals(path) if n.split(".")[0] == "trainfuse")
    assert not ours, (path.name, ours)
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert {"model", "ema", "optimizer", "epoch", "train_args", "updates", "scaler"} <= ckpt.keys(), path.name
    model = ckpt["model"] if ckpt["ema"] is None else ckpt["ema"]  # finished run's last.pt: the EMA as model
    assert type(model) is DetectionModel and getattr(model, "criterion", None) is None, path.name
    if ckpt["optimizer"] is not None:  # mid-run: ultralytics resumes from the EMA, "model" stays None
        assert ckpt["model"] is None and ckpt["optimizer"].keys() == {"state", "param_groups"}, path.name
        # an empty entry: a param with no state, the frozen DFL conv; on one GPU the casts give it a
        # float32 master, which the saved layout drops (torch.optim has no entry; it loads either)
        layouts = {frozenset(s) for s in ckpt["optimizer"]["state"].values()}
        assert layouts <= {frozenset({"step", "exp_avg", "exp_avg_sq"}), frozenset()}, (path.name, layouts)
        assert not any("master_weights" in g for g in ckpt["optimizer"]["param_groups"]), path.name
    return ckpt


def _resume(run: Path, device: str, trainer, out: Path) -> tuple[dict, list[dict]]:
    """Resume the interrupted run in folder ``run`` on ``device`` with ``trainer`` (None: stock
    ultralytics), as a user resumes a run stopped after its second epoch of three. Returns the
    checkpoint it resumed from and each rank's :class:`ResumeRecord`."""
    ckpt = _stock_checkpoint(run / "weights" / "epoch1.pt")
    # last.pt of a run of three epochs, in this folder: resume takes epochs from the checkpoint
    # (a resume may change device, batch, imgsz, workers... not epochs) and continues at epoch + 1
    ckpt["train_args"].update(epochs=RESUME_EPOCHS, save_dir=str(run))
    last = run / "weights" / "last.pt"
    torch.save(ckpt, last)
    model = YOLO(str(last))
    ResumeRecord(str(out), "resumed").attach(model)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    model.train(resume=True, device=device, trainer=trainer)
    return ckpt, [torch.load(out / f"resumed-rank{r}.pt") for r in range(len(device.split(",")))]


def _assert_resumed(run: Path, ckpt: dict, ranks: list[dict]) -> None:
    """What a resume must do, whichever the trainer and the devices: every rank starts at the third
    epoch (saved epoch + 1) with the optimizer, EMA and GradScaler state as saved and trains that
    epoch only, to finite losses; results.csv goes on from the two saved rows; the checkpoints it
    writes are stock, its optimizer steps counted on from the saved ones, its weights moved."""
    saved = {i: s for i, s in ckpt["optimizer"]["state"].items() if s}
    assert ckpt["epoch"] == RESUME_EPOCHS - 2 and saved and all(float(s["step"]) > 0 for s in saved.values())
    for r in ranks:
        assert (r["start_epoch"], r["epochs"]) == (RESUME_EPOCHS - 1, RESUME_EPOCHS), r["start_epoch"]
        assert r["world_size"] == len(ranks)
        assert r["updates"] == ckpt["updates"] and r["scaler"] == ckpt["scaler"]
        assert r["state"].keys() == saved.keys()  # loaded, not made afresh by the first step
        for i, s in saved.items():
            assert float(r["state"][i]["step"]) == float(s["step"]), i
            assert torch.equal(r["state"][i]["exp_avg"], s["exp_avg"].float()), i
        assert len(r["losses"]) == RESUME_ITERATIONS, len(r["losses"])  # the third epoch only
        assert all(math.isfinite(x) for x in r["losses"] + r["tloss"]), (r["losses"], r["tloss"])
    for k, v in ranks[0]["weights"].items():  # the ranks' weights the same (BatchNorm's statistics per rank)
        if "running" not in k and "num_batches" not in k:
            assert all(torch.equal(v, r["weights"][k]) for r in ranks[1:]), k
    with open(run / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(float(row["epoch"])) for row in rows] == [1, 2, 3]
    assert all(math.isfinite(float(row[k])) for row in rows for k in row if k.startswith("train/")), rows
    mid = _stock_checkpoint(run / "weights" / "epoch2.pt")  # the resumed run's own mid-run checkpoint
    assert mid["epoch"] == RESUME_EPOCHS - 1 and mid["updates"] > ckpt["updates"]
    # its steps go on from the saved ones (3 optimizer steps in the third epoch, fewer where GradScaler skips)
    advanced = {float(s["step"]) - float(saved[i]["step"]) for i, s in mid["optimizer"]["state"].items() if s}
    assert advanced and advanced <= {1, 2, 3}, advanced
    final = _stock_checkpoint(run / "weights" / "last.pt")
    assert final["epoch"] == -1 and final["optimizer"] is None  # finished: stripped as stock strips it
    before, after = ckpt["ema"].state_dict(), final["model"].state_dict()
    floats = [k for k, v in before.items() if v.is_floating_point()]
    moved = [k for k in floats if not torch.equal(before[k], after[k])]
    assert len(moved) > len(floats) // 2, (len(moved), len(floats))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Interrupted runs of FusedDetectionTrainer (:func:`_interrupted_run`) by device, made on first
    use; each test resumes a copy of its own."""
    root = tmp_path_factory.mktemp("shapes-resume")
    data = str(make_shapes_dataset(root, n_train=40, n_val=8, imgsz=64, seed=1))
    project = tmp_path_factory.mktemp("runs-resume")
    made: dict[str, Path] = {}

    def get(device: str) -> Path:
        if device not in made:
            made[device] = _interrupted_run(data, project, device)
        return made[device]

    return get


@two_gpus
@pytest.mark.parametrize("resumed_by", [FusedDetectionTrainer, None], ids=["fused", "stock"])
@pytest.mark.parametrize("saved_on,resumed_on", [("0,1", "0,1"), ("0,1", "0"), ("0", "0,1")],
                         ids=["2gpus-to-2gpus", "2gpus-to-1gpu", "1gpu-to-2gpus"])
def test_checkpoint_stays_stock_and_resumes_on_another_rank_count(interrupted, saved_on, resumed_on,
                                                                  resumed_by, tmp_path):
    """A checkpoint of the fused trainer, saved under DDP or on one GPU, resumes under DDP or on one
    GPU with the fused trainer or with stock ultralytics (which resumes it as it resumes its own):
    the same epochs, the state as saved (:func:`_assert_resumed`). The fused resume fuses again what
    the load made stock (the EMA, the GradScaler) and keeps its CUDA graphs: on 2 GPUs with the flat
    all-reduce in place of DDP's reducer, on 1 GPU with the casts (the masters made anew from the
    float32 weights loaded)."""
    run = tmp_path / "run"
    shutil.copytree(interrupted(saved_on), run)  # the resume writes into the run's folder: a copy each
    ckpt, ranks = _resume(run, resumed_on, resumed_by, tmp_path)
    assert ckpt["train_args"]["device"] == saved_on and ckpt["scaler"].get("scale", 0) > 0  # AMP: scale saved
    _assert_resumed(run, ckpt, ranks)
    ddp = len(ranks) == 2
    for r in ranks:
        if resumed_by is None:
            assert (r["optimizer"], r["ema"]) == ("AdamW", "ModelEMA")
            assert r["scaler_class"] == "torch.amp.grad_scaler.GradScaler", r["scaler_class"]
            continue
        assert (r["optimizer"], r["ema"]) == ("FusedAdamW", "FusedEMA")
        assert r["scaler_class"].startswith("trainfuse."), r["scaler_class"]
        assert r["graphs_reason"] == "", r["graphs_reason"]
        assert (["ddp", "swapped"] in r["report"]) == ddp, r["report"]
        assert ["casts", "skipped" if ddp else "on"] in r["report"], r["report"]
