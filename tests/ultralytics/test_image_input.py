"""The training batches handed to the model as uint8 images (``raw_images=True``,
:mod:`trainfuse.ultralytics.changes.image_input`), in real ultralytics runs on CPU: the first
convolution receives the uint8 batch and the run's losses and weights are the same run's with the
images made float32 by ultralytics' ``preprocess_batch`` (``raw_images=False``), bit for bit; and
the settings it stays off for, each with its reason."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.models.yolo.classify import ClassificationTrainer  # noqa: E402
from ultralytics.models.yolo.detect import DetectionTrainer  # noqa: E402

from trainfuse.clients import OFF, ON, SKIPPED  # noqa: E402
from trainfuse.ultralytics import (  # noqa: E402
    FusedClassificationTrainer,
    FusedDetectionTrainer,
    FusedSegmentationTrainer,
)
from trainfuse.ultralytics.changes.image_input import preprocess_owner  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402
from trainfuse.ultralytics.task_shapes import make_task_dataset  # noqa: E402


class StepTrainer(FusedDetectionTrainer):
    """ultralytics' loss (the fused optimizer phase only; on CPU a run equal to stock's), the model
    taking uint8 images."""

    fused_loss = False
    raw_images = True


class OwnPreprocessTrainer(StepTrainer):
    """A user's trainer that reads the float images in its own preprocessing."""

    def preprocess_batch(self, batch: dict) -> dict:
        batch = super().preprocess_batch(batch)
        assert batch["img"].dtype == torch.float32 and batch["img"].max() <= 1
        return batch


class SegmentTrainer(FusedSegmentationTrainer):
    """The segmentation trainer (its fused loss; the batches carry masks), the model taking uint8
    images."""

    raw_images = True


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return str(make_shapes_dataset(tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, imgsz=64, seed=0))


@pytest.fixture(scope="module")
def segment_data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("segment")
    return str(make_task_dataset(root, "segment", n_train=8, n_val=4, imgsz=64, max_objects=3))


def _train(data: str, project: Path, trainer, model_name: str = "yolov5n.yaml", epochs: int = 2,
           **train_args):
    """A run of ``epochs`` epochs (2 iterations each); its model, losses, the dtypes its first
    convolution received in training mode and the ``input`` row of its report."""
    model = YOLO(model_name)
    losses: list[float] = []
    seen: list[torch.dtype] = []

    def watch(t):
        conv = t.model.model[0].conv
        conv.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype) if m.training else None)

    model.add_callback("on_train_start", watch)
    model.add_callback("on_train_batch_end", lambda t: losses.append(float(t.loss.detach())))
    name = f"{getattr(trainer, 'func', trainer).__name__}-{len(list(project.iterdir()))}"
    model.train(data=data, epochs=epochs, imgsz=64, batch=4, workers=0, device="cpu", plots=False, val=False,
                seed=0, deterministic=True, verbose=False, optimizer="SGD", box=0.75, cls=0.05, dfl=0.15,
                project=str(project), name=name, exist_ok=True, trainer=trainer, **train_args)
    row = next(r for r in model.trainer.report if r.kind == "input")
    return model, losses, seen, row


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_the_model_takes_uint8_images_and_trains_as_with_float_ones(data, segment_data, tmp_path, task):
    trainer, model, where, epochs = ((StepTrainer, "yolov5n.yaml", data, 2) if task == "detect"
                                     else (SegmentTrainer, "yolov8n-seg.yaml", segment_data, 1))
    raw, raw_losses, raw_seen, row = _train(where, tmp_path, trainer, model, epochs)
    assert row.action == ON and "uint8" in row.detail
    assert raw_seen == [torch.uint8] * 2 * epochs
    floats = functools.partial(trainer, raw_images=False)
    ref, ref_losses, ref_seen, ref_row = _train(where, tmp_path, floats, model, epochs)
    assert ref_row.action == OFF and ref_row.detail == "raw_images=False"
    assert ref_seen == [torch.float32] * 2 * epochs
    assert raw_losses == ref_losses
    ours, theirs = raw.trainer.model.state_dict(), ref.trainer.model.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert "forward" not in raw.trainer.model.model[0].conv.__dict__  # given back when training ended


@pytest.mark.parametrize("case,reason", [
    ("multi_scale", "multi_scale=0.5 resizes the float images"),
    ("own_preprocess", "OwnPreprocessTrainer.preprocess_batch may read the float images"),
], ids=["multi_scale", "own_preprocess"])
def test_stays_off_where_float_images_are_read(data, tmp_path, case, reason):
    multi = case == "multi_scale"
    trainer, args = (StepTrainer, {"multi_scale": 0.5}) if multi else (OwnPreprocessTrainer, {})
    _, losses, seen, row = _train(data, tmp_path, trainer, epochs=1, **args)
    assert row.action == SKIPPED and row.detail.startswith(reason)
    assert torch.float32 in seen and torch.uint8 not in seen and len(losses) == 2


def test_preprocess_owner_is_the_first_class_outside_trainfuse():
    assert preprocess_owner(FusedDetectionTrainer.__new__(FusedDetectionTrainer)) is DetectionTrainer
    assert preprocess_owner(OwnPreprocessTrainer.__new__(OwnPreprocessTrainer)) is OwnPreprocessTrainer
    owner = preprocess_owner(FusedClassificationTrainer.__new__(FusedClassificationTrainer))
    assert owner is ClassificationTrainer
