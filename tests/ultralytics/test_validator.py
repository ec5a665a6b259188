"""FusedDetectionValidator against ultralytics' DetectionValidator: the same per-image statistics
(``tp``, ``conf``, ``pred_cls``, ``target_cls``, ``target_img``, ``im_name``: values, dtypes and
shapes), the same metrics, and the same per-image extras (confusion matrix, JSON, text results,
the plotted predictions).

Three levels: both validators driven batch by batch on synthetic predictions placed near the labels
(so that detections match at some thresholds and not others; float32 and float16, square and
non-square batches, images without labels or without candidates, a partial last batch);
``model.val`` of a YOLOv5n on the shapes dataset (square and rect batches); and a short
FusedDetectionTrainer run whose epoch-end validation stock's validator repeats on the same
weights. The kernels run through the interpreter on CPU (``path``)."""

from __future__ import annotations

import tempfile
from copy import copy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests._helpers import cuda, no_host_sync
from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.models.yolo.detect import DetectionValidator  # noqa: E402
from ultralytics.models.yolo.detect import val as detect_val  # noqa: E402

from trainfuse.ultralytics import FusedDetectionTrainer, FusedDetectionValidator  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NC = 3
MAX_DET = 16  # the interpreter matches detection by detection: few of them keep the tests fast


# ---- batch by batch ---------------------------------------------------------------------------------
def synthetic_batches(root: Path, counts: list[list[int]], imgsz: tuple[int, int], dtype: torch.dtype,
                      anchors: int = 24) -> list[tuple[dict, torch.Tensor]]:
    """``(batch, prediction)`` pairs, ``counts[k][i]`` labels in image i of batch k. Each label gets
    a few jittered detection boxes of its class or another; the rest are random boxes; an image
    with a negative count has no labels and scores below the confidence threshold."""
    h, w = imgsz
    out, k = [], 0
    for sizes in counts:
        B = len(sizes)
        labels = [max(c, 0) for c in sizes]
        n = sum(labels)
        xy, wh = torch.rand(n, 2) * 0.6 + 0.2, torch.rand(n, 2) * 0.3 + 0.1
        batch = {"img": torch.zeros(B, 3, h, w, dtype=torch.uint8),
                 "batch_idx": torch.cat([torch.full((c,), float(i)) for i, c in enumerate(labels)]),
                 "cls": torch.randint(0, NC, (n, 1)).float(), "bboxes": torch.cat([xy, wh], 1),
                 "ori_shape": [(2 * h, 2 * w)] * B, "ratio_pad": [((0.5, 0.5), (0.0, 0.0))] * B,
                 "im_file": [str(root / "images" / f"{k + i:03d}.jpg") for i in range(B)]}
        k += B
        pred = torch.empty(B, 4 + NC, anchors)
        pred[:, :2] = torch.rand(B, 2, anchors) * torch.tensor([w, h]).view(1, 2, 1)
        pred[:, 2:4] = torch.rand(B, 2, anchors) * 20 + 2
        pred[:, 4:] = torch.rand(B, NC, anchors) ** 2
        start = 0
        for i, c in enumerate(labels):
            for j in range(min(3 * c, anchors)):  # 3 near each label
                label = start + j // 3
                pred[i, :2, j] = xy[label] * torch.tensor([w, h]) + torch.randn(2) * 2
                pred[i, 2:4, j] = wh[label] * torch.tensor([w, h]) * (1 + 0.2 * torch.randn(2))
                pred[i, 4 + int(batch["cls"][label]), j] += 0.5 * torch.rand(())
            start += c
            if sizes[i] < 0:
                pred[i, 4:] *= 1e-4
        out.append((batch, pred.to(dtype)))
    return out


def drive(cls, batches: list[tuple[dict, torch.Tensor]], save_dir: Path, files: list[str],
          finish: bool = True, **args):
    """Run ``cls`` over the batches as ``BaseValidator.__call__`` does; return it, its per-image
    statistics and its results (None unless ``finish``: the metrics, with plots their curves).
    Stock's validator runs on the CPU, where torchvision sorts equal scores stably, as the kernels
    do; on a GPU its order of equal scores is its own."""
    device = DEVICE if cls is FusedDetectionValidator else torch.device("cpu")
    v = cls(save_dir=save_dir, args={"max_det": MAX_DET, "plots": False, **args})
    v.device, v.training, v.data = device, False, {"val": str(save_dir)}
    v.dataloader = SimpleNamespace(dataset=SimpleNamespace(im_files=files), sampler=range(len(files)))
    v.init_metrics(SimpleNamespace(names={i: f"c{i}" for i in range(NC)}))
    stats = []
    update = v.metrics.update_stats
    v.metrics.update_stats = lambda stat: (stats.append(stat), update(stat))
    for i, (batch, pred) in enumerate(batches):
        batch = v.preprocess(dict(batch))
        preds = v.postprocess(pred.to(device))
        v.update_metrics(preds, batch)
        if v.args.plots:
            v.plot_predictions(batch, preds, i)
    v.gather_stats()
    return v, stats, v.get_stats() if finish else None


def assert_same_stats(ours: list[dict], theirs: list[dict], ordered: bool = True) -> None:
    """The same statistics, image by image; without ``ordered``, each image's detections compared
    as a set (the order of equal confidences may differ)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        assert a["im_name"] == b["im_name"]
        for key in a.keys() - {"im_name"}:
            assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key
        if not ordered:
            a, b = as_set(a), as_set(b)
        for key in a.keys() - {"im_name"}:
            assert np.array_equal(a[key], b[key]), key


def as_set(stat: dict) -> dict:
    """``stat`` with its detections sorted by confidence, class and ``tp``."""
    order = np.lexsort((*stat["tp"].T, stat["pred_cls"], stat["conf"]))
    return {**stat, **{k: stat[k][order] for k in ("conf", "pred_cls", "tp")}}


@pytest.mark.parametrize("dtype,imgsz", [(torch.float32, (64, 64)), (torch.float16, (64, 96))])
def test_batches_give_stock_statistics(path, tmp_path, dtype, imgsz):
    batches = synthetic_batches(tmp_path, [[3, 0, 5], [2, -1]], imgsz, dtype)
    files = [f for batch, _ in batches for f in batch["im_file"]]
    stock, expected, results = drive(DetectionValidator, batches, tmp_path / "stock", files)
    fused, got, fused_results = drive(FusedDetectionValidator, batches, tmp_path / "fused", files)
    assert_same_stats(got, expected)
    assert fused_results == results and fused.seen == stock.seen == 5
    assert fused.metrics.box.image_metrics == stock.metrics.box.image_metrics
    tp = np.concatenate([s["tp"] for s in expected])
    assert tp[:, 0].sum() > tp[:, -1].sum()  # detections that match at some thresholds only
    assert [len(s["conf"]) for s in expected][3:] == [MAX_DET, 0]


def test_per_image_extras_are_stock(path, tmp_path, monkeypatch):
    """Confusion matrix, COCO JSON (custom: with the ground truth it builds), text results and the
    predictions handed to the plot."""
    plotted = []
    monkeypatch.setattr(detect_val, "plot_images", lambda **kw: plotted.append(kw.get("labels")))
    batches = synthetic_batches(tmp_path, [[2, 4], [0, 3]], (64, 96), torch.float32)
    files = [f for batch, _ in batches for f in batch["im_file"]]
    args = {"plots": True, "save_json": True, "save_txt": True, "save_conf": True, "finish": False}
    stock, expected, _ = drive(DetectionValidator, batches, tmp_path / "stock", files, **args)
    stock_plots, plotted[:] = list(plotted), []
    fused, got, _ = drive(FusedDetectionValidator, batches, tmp_path / "fused", files, **args)
    assert_same_stats(got, expected)
    assert np.array_equal(fused.confusion_matrix.matrix, stock.confusion_matrix.matrix)
    assert fused.confusion_matrix.matrix.sum() > 0
    assert fused.jdict == stock.jdict and len(fused.jdict) > 0
    assert fused.gdict == stock.gdict and fused.pred_counts == stock.pred_counts
    texts = sorted((tmp_path / "stock" / "labels").glob("*.txt"))
    assert len(texts) == 4
    for f in texts:
        assert (tmp_path / "fused" / "labels" / f.name).read_text() == f.read_text()
    predictions = [p for p in stock_plots if "conf" in p]
    assert len(predictions) == len([p for p in plotted if "conf" in p]) == 2
    for ours, theirs in zip([p for p in plotted if "conf" in p], predictions):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k].cpu(), theirs[k].cpu()) for k in ours)


@cuda
def test_a_batch_is_queued_without_host_sync(tmp_path, monkeypatch):
    """NMS, matching and the copies of a batch: nothing waits for the GPU until the next batch."""
    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    batches = synthetic_batches(tmp_path, [[3, 0, 5], [2, 1, 4]], (64, 96), torch.float16)
    files = [f for batch, _ in batches for f in batch["im_file"]]
    drive(FusedDetectionValidator, batches, tmp_path / "warm", files)  # compiles the kernels
    v = FusedDetectionValidator(save_dir=tmp_path / "fused", args={"max_det": MAX_DET, "plots": False})
    v.device, v.training, v.data = DEVICE, False, {"val": str(tmp_path)}
    v.dataloader = SimpleNamespace(dataset=SimpleNamespace(im_files=files), sampler=range(len(files)))
    v.init_metrics(SimpleNamespace(names={i: f"c{i}" for i in range(NC)}))
    batch, pred = batches[0]
    batch, pred = v.preprocess(dict(batch)), pred.to(DEVICE)
    with no_host_sync():
        v.update_metrics(v.postprocess(pred), batch)
    assert len(v.queued) == 1 and v.seen == 0
    v.gather_stats()
    assert v.seen == 3


# ---- model.val and a training run -------------------------------------------------------------------
@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {photo: str(make_shapes_dataset(root / str(photo), n_train=4, n_val=6, imgsz=64, photo=photo))
            for photo in (False, True)}


def scored_yolo() -> YOLO:
    """An untrained YOLOv5n whose class scores start near 0.5 rather than 0.0001: every image has
    its full count of detections to match."""
    model = YOLO("yolov5n.yaml")
    with torch.no_grad():
        for branch in model.model.model[-1].cv3:
            branch[-1].bias.normal_(0, 1)
    return model


@pytest.mark.parametrize("photo", [False, True], ids=["square", "rect"])
def test_model_val_gives_stock_metrics(path, datasets, tmp_path, photo):
    model = scored_yolo()

    def val(cls):
        stats = []

        class Recording(cls):
            def init_metrics(self, m):
                super().init_metrics(m)
                update = self.metrics.update_stats
                self.metrics.update_stats = lambda stat: (stats.append(stat), update(stat))

        metrics = model.val(data=datasets[photo], imgsz=64, batch=4, device=DEVICE.type, workers=0,
                            plots=False, verbose=False, max_det=MAX_DET, validator=Recording,
                            project=str(tmp_path), name=cls.__name__)
        return stats, metrics.results_dict

    expected, results = val(DetectionValidator)
    got, fused_results = val(FusedDetectionValidator)
    # stock on a GPU orders equal confidences its own way (torchvision's unstable sort)
    assert_same_stats(got, expected, ordered=DEVICE.type == "cpu")
    assert fused_results == results
    assert [len(s["conf"]) for s in got] == [MAX_DET] * 6


class StockLossTrainer(FusedDetectionTrainer):
    """The fused trainer with ultralytics' loss: the run is short, the validation is the point. The
    validation batches are kept after their first pass, as on CUDA by default."""

    fused_loss = False
    device_cache = True


@pytest.mark.cpu_training
def test_trainer_validates_as_stock_on_the_same_weights(datasets, tmp_path, monkeypatch):
    """Each epoch's validation of the EMA, and the final one of ``best.pt``, repeated by stock; after
    the first pass the validator reads the batches it kept, not the loader."""
    # torch's path: the kernels are tested above; a run's optimizer kernels take minutes in the interpreter
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    model = scored_yolo()
    epochs, loads, counted = [], [0], [0]

    def count_loads(trainer):
        dataset = trainer.test_loader.dataset
        load = dataset.load_image
        dataset.load_image = lambda *a, **k: (loads.__setitem__(0, loads[0] + 1), load(*a, **k))[1]

    def validate_with_stock(trainer):
        if trainer.epoch < trainer.epochs:  # not the final validation (of best.pt, checked below)
            ours = loads[0] - counted[0]
            stock = DetectionValidator(trainer.test_loader, save_dir=tmp_path / "stock",
                                       args=copy(trainer.args))
            epochs.append((type(trainer.validator), dict(trainer.metrics), stock(trainer=trainer), ours))
            counted[0] = loads[0]

    model.add_callback("on_pretrain_routine_end", count_loads)
    model.add_callback("on_fit_epoch_end", validate_with_stock)
    model.train(data=datasets[False], epochs=2, imgsz=64, batch=4, workers=0, device="cpu", plots=False,
                val=True, seed=0, deterministic=True, verbose=False, max_det=MAX_DET, project=str(tmp_path),
                name="run", trainer=StockLossTrainer)
    assert [e[3] for e in epochs] == [6, 0] and loads[0] == counted[0]  # the final validation read none
    for validator, metrics, stock, _ in epochs:
        assert validator is FusedDetectionValidator
        stock.pop("fitness")
        assert {k: metrics[k] for k in stock} == stock and metrics["val/cls_loss"] > 0
    best = YOLO(str(model.trainer.best))
    final = best.val(data=datasets[False], imgsz=64, batch=4, device="cpu", workers=0, plots=False,
                     verbose=False, max_det=MAX_DET, project=str(tmp_path), name="stock-final").results_dict
    final.pop("fitness")
    assert model.trainer.metrics == final
    rows = {(r.kind, r.name): r for r in model.trainer.report}
    assert rows["device cache", "validation batches"].action == "on"
    assert rows["device cache", "decoded training images"].action == "skipped"
    assert model.trainer.validator.dataloader is model.trainer.test_loader  # given back when training ended
