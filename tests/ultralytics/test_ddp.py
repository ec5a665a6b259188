"""FusedDetectionTrainer under ultralytics' own DDP (``device="0,1"``; 2 GPUs, NCCL).

ultralytics launches the ranks itself (``torch.distributed.run`` over a pickled trainer), so what
each rank did comes back through a callback that writes a file per rank (:class:`RankRecord`). The
graphed run (replays, then one flat all-reduce per optimizer step) is compared with the same
trainer run eagerly under DDP's reducer (an all-reduce per backward), over 100 iterations of SGD,
whose update scales with the grads (a wrong factor in the reduction shows; Adam would hide it).
Once the accumulation ramps up the two add the micro-batches in another order, so they agree to
float32 rounding grown over the run; every rank holds the same weights bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
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


def _ddp_run(trainer, data: str, project: Path, name: str, **kw) -> list[tuple[dict, dict]]:
    model = YOLO("yolov5n.yaml")
    RankRecord(str(project), name).attach(model)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off
    model.train(data=data, epochs=20, imgsz=64, batch=8, nbs=16, workers=0, device="0,1", plots=False,
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
def test_batch_below_one_is_refused_under_ddp_as_stock_refuses_it(tmp_path):
    data = str(make_shapes_dataset(tmp_path / "d", n_train=8, n_val=4, imgsz=64, seed=0))
    for trainer in (None, FusedDetectionTrainer):
        with pytest.raises(ValueError, match="AutoBatch with batch<1 not supported for Multi-GPU"):
            YOLO("yolov5n.yaml").train(data=data, epochs=1, imgsz=64, batch=-1, device="0,1", plots=False,
                                       project=str(tmp_path), name="auto", exist_ok=True,
                                       **({"trainer": trainer} if trainer else {}))
