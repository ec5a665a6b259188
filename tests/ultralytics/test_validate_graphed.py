"""GraphedEval, the trainer's validation forward from CUDA graphs and its fused loss: off CUDA (and
for anything but an inference call) it is the model itself; on a GPU its replays equal the eager
forward bit for bit over batches of changing shapes (the heads' cached anchors cannot go stale),
without a host sync; and a training run's per-epoch metrics equal stock's validator on the same
weights."""

from __future__ import annotations

import tempfile
from copy import copy
from pathlib import Path

import pytest
import torch

from tests._helpers import cuda, no_host_sync
from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.models.yolo.detect import DetectionValidator  # noqa: E402
from ultralytics.nn.tasks import DetectionModel  # noqa: E402

from trainfuse.ultralytics import FusedDetectionTrainer, FusedDetectionValidator  # noqa: E402
from trainfuse.ultralytics.loss import FusedDetectionLoss  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402
from trainfuse.ultralytics.validate.graphed import GraphedEval, graphable  # noqa: E402


def _model(device: str = "cpu") -> DetectionModel:
    torch.manual_seed(0)
    model = DetectionModel("yolov5n.yaml", nc=3, verbose=False).to(device).eval()
    model.args = get_cfg()  # the hyperparameters a loss reads, as the trainer sets them
    return model


def _batch(n: int, h: int, w: int, device: str) -> dict:
    g = torch.Generator().manual_seed(n * 1000 + h + w)
    labels = 2 * n
    return {"img": torch.rand(n, 3, h, w, generator=g).to(device),
            "batch_idx": torch.arange(n).repeat_interleave(2).float().to(device),
            "cls": torch.randint(0, 3, (labels, 1), generator=g).float().to(device),
            "bboxes": (torch.rand(labels, 4, generator=g) * 0.4 + 0.2).to(device)}


def test_off_cuda_it_is_the_model_and_its_loss_is_the_fused_one(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    model = _model()
    graphed = GraphedEval(model)
    assert graphed.float() is graphed and not graphed.eval().model.training
    batch = _batch(2, 64, 96, "cpu")
    with torch.no_grad():
        ours, theirs = graphed(batch["img"]), model(batch["img"])
        assert torch.equal(ours[0], theirs[0])
        loss = graphed.loss(batch, ours)
        stock = model.loss(batch, theirs)
    assert isinstance(graphed.criterion, FusedDetectionLoss)
    assert loss[1].keys() == stock[1].keys()
    for k in stock[1]:
        torch.testing.assert_close(loss[1][k], stock[1][k], rtol=1e-4, atol=1e-5, msg=k)
    assert graphed.stats.replays == 0 and graphed.stats.eager == 0  # never reached the graphs


def test_fits_follows_where_the_tensors_live():
    model = _model()
    graphed = GraphedEval(model)
    assert graphed.fits(model.float())  # already float32: the same storage
    assert not graphed.fits(_model())
    model.half()
    assert not graphed.fits(model)


@pytest.mark.parametrize("cfg,expected", [("yolov5n.yaml", True), ("yolo26n.yaml", False)])
def test_end_to_end_heads_are_not_graphed(cfg, expected):
    assert graphable(DetectionModel(cfg, nc=3, verbose=False)) is expected


@cuda
def test_replays_equal_the_eager_forward_bit_for_bit_across_shapes_without_host_syncs():
    model = _model("cuda")
    graphed = GraphedEval(model)
    shapes = [(4, 64, 64), (4, 64, 64), (4, 64, 96), (4, 64, 96), (2, 64, 64), (2, 64, 64), (4, 64, 64),
              (4, 64, 96), (2, 64, 64), (4, 64, 64)]
    seen = set()
    with torch.inference_mode(), torch.autocast("cuda", torch.float16):
        for i, (n, h, w) in enumerate(shapes):
            img = _batch(n, h, w, "cuda")["img"].half()
            expected = model(img)
            if (n, h, w) in seen:  # a shape's anchors are computed (a host sync) at its first batch only
                with no_host_sync():
                    got = graphed(img)
            else:
                got = graphed(img)
            seen.add((n, h, w))
            assert torch.equal(got[0], expected[0]), (i, n, h, w)
            for k in ("boxes", "scores"):
                assert torch.equal(got[1][k], expected[1][k]), (i, k)
    # per shape: as it is, then watched (eager), then captured and replayed
    assert graphed.stats.captures == 3 and graphed.stats.eager == 3 and graphed.stats.fallbacks == 0
    assert graphed.stats.replays == 4


@cuda
def test_a_training_run_validates_with_graphs_as_stock_on_the_same_weights(tmp_path):
    data = make_shapes_dataset(tmp_path / "data", n_train=16, n_val=12, imgsz=64, photo=True)
    epochs = []

    def validate_with_stock(trainer):
        if trainer.epoch < trainer.epochs:  # the per-epoch validations, not the final one of best.pt
            stock = DetectionValidator(trainer.test_loader, save_dir=tmp_path / "stock",
                                       args=copy(trainer.args))
            epochs.append((dict(trainer.metrics), stock(trainer=trainer)))

    model = YOLO("yolov5n.yaml")
    model.add_callback("on_fit_epoch_end", validate_with_stock)
    model.train(data=str(data), epochs=3, imgsz=64, batch=4, workers=0, device=0, plots=False, seed=0,
                deterministic=True, verbose=False, project=str(tmp_path), name="run",
                trainer=FusedDetectionTrainer)
    validator = model.trainer.validator
    assert isinstance(validator, FusedDetectionValidator) and validator.graphed is not None
    assert validator.graphed.stats.replays > 0 and validator.graphed.stats.fallbacks == 0
    assert len(epochs) == 3
    for ours, stock in epochs:
        for k in stock:
            if k.startswith("val/"):  # the fused loss against stock's: float rounding apart
                assert ours[k] == pytest.approx(stock[k], rel=1e-3, abs=1e-4), k
            elif k != "fitness":
                assert ours[k] == stock[k], k


@cuda
def test_model_val_replays_the_backend_model_and_gives_stock_metrics(tmp_path):
    data = make_shapes_dataset(tmp_path / "data", n_train=4, n_val=12, imgsz=64, photo=True)
    graphed = []

    class Recording(FusedDetectionValidator):
        def graph_backend(self, model):
            super().graph_backend(model)
            graphed.append(model.backend.model)

    model = YOLO("yolov5n.yaml")
    with torch.no_grad():  # class scores near 0.5: every image has detections to match
        for branch in model.model.model[-1].cv3:
            branch[-1].bias.normal_(0, 1)
    kwargs = {"data": str(data), "imgsz": 64, "batch": 4, "device": 0, "workers": 0, "plots": False,
              "verbose": False, "project": str(tmp_path)}
    stock = model.val(validator=DetectionValidator, name="stock", **kwargs).results_dict
    ours = model.val(validator=Recording, name="ours", **kwargs).results_dict
    (g,) = graphed
    assert isinstance(g, GraphedEval)
    assert g.stats.captures == 1 and g.stats.replays == 1 and g.stats.fallbacks == 0  # 3 batches, 1 shape
    assert ours == stock
