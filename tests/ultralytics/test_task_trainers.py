"""The fused trainers of segmentation, pose, OBB and classification against ultralytics' own trainers
of those tasks, on CPU (the fused optimizers take torch's path, so a run is stock's bit for bit
where no step clips; runs scale the loss gains down so that none does, as test_trainer.py's), on
the synthetic datasets of :mod:`trainfuse.ultralytics.task_shapes`; and the helper that picks a
model's trainer."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.models.yolo.pose import PoseTrainer  # noqa: E402
from ultralytics.models.yolo.segment import SegmentationTrainer  # noqa: E402
from ultralytics.utils import DEFAULT_CFG  # noqa: E402

import trainfuse  # noqa: E402
from trainfuse.losses.detection import PadTargets  # noqa: E402
from trainfuse.ultralytics import (  # noqa: E402
    FusedClassificationTrainer,
    FusedDetectionTrainer,
    FusedOBBTrainer,
    FusedPoseTrainer,
    FusedSegmentationTrainer,
    trainer_for,
)
from trainfuse.ultralytics.task_shapes import CLASSES, FLIP_IDX, KPT_SHAPE, make_task_dataset  # noqa: E402

MODELS = {"segment": "yolov8n-seg.yaml", "pose": "yolov8n-pose.yaml", "obb": "yolov8n-obb.yaml",
          "classify": "yolov8n-cls.yaml"}
TRAINERS = {"segment": FusedSegmentationTrainer, "pose": FusedPoseTrainer, "obb": FusedOBBTrainer,
            "classify": FusedClassificationTrainer}
LOSS_GAINS = ("box", "cls", "dfl", "pose", "kobj", "angle", "rle")  # ultralytics' loss gains (masks: box)
FUSED_LOSSES = {"segment": "FusedSegmentationLoss", "pose": "FusedPoseLoss", "obb": "FusedOBBLoss"}
GAIN = 0.02  # every loss gain scaled down (box, cls, dfl, angle, pose, kobj, rle)
# The segmentation and pose models' gradient norms reach ultralytics' clip at 10 whatever the gains
# (15.6 at the first step of the segmentation run). The fused step clips with torch's
# clip_grad_norm_ over the params in param-group order, ultralytics over model.parameters(): the
# per-tensor norms summed in another order, a clip coefficient a last bit apart, which AdamW's
# per-element scaling grows within four steps to 1 % of a step in some weights. The exact check
# of those tasks runs against ultralytics' trainer with only that order changed (GroupOrderClip)
CLIPS = {"segment", "pose"}
STOCK_TRAINERS = {"segment": SegmentationTrainer, "pose": PoseTrainer}


def _group_order_clip(trainer_cls):
    """``trainer_cls`` (ultralytics' own trainer of a task) with BaseTrainer.optimizer_step's clip
    taking the params in the optimizer's param-group order; the rest of the step as ultralytics'."""

    class GroupOrderClip(trainer_cls):
        def optimizer_step(self):
            self.scaler.unscale_(self.optimizer)
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, max_norm=10.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
            if self.ema:
                self.ema.update(self.model)

    return GroupOrderClip


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    return {task: str(make_task_dataset(root / task, task, n_train=8, n_val=4, imgsz=64, max_objects=3))
            for task in MODELS}


def _train(task: str, data: str, project: Path, trainer=None, model_file: str | None = None):
    model = YOLO(model_file or MODELS[task])
    losses: list[torch.Tensor] = []
    model.add_callback("on_train_batch_end", lambda t: losses.append(t.loss.detach().clone()))
    gains = {} if task == "classify" else {k: getattr(DEFAULT_CFG, k) * GAIN for k in LOSS_GAINS}
    model.train(data=data, epochs=2, imgsz=64 if task != "classify" else 32, batch=4, nbs=8, workers=0,
                device="cpu", plots=False, val=True, seed=0, deterministic=True, verbose=False,
                optimizer="AdamW", lr0=0.002, project=str(project),
                name=f"{Path(model_file or MODELS[task]).stem}-{trainer.__name__ if trainer else 'stock'}",
                exist_ok=True, **gains, **({"trainer": trainer} if trainer else {}))
    return model, losses


# the fused trainers with ultralytics' own losses (segment, pose and OBB take theirs by default): the
# runs that match stock exactly. They keep the validation batches after the first pass, as on CUDA by
# default (the task's own validator then reads the kept batches: the metrics must not move)
STOCK_LOSS = {task: type(f"StockLoss{TRAINERS[task].__name__}", (TRAINERS[task],),
                         {"device_cache": True, **({"fused_loss": False} if task in ("segment", "pose", "obb")
                                                   else {})}) for task in TRAINERS}


@pytest.fixture(scope="module")
def runs(datasets, tmp_path_factory):
    project = tmp_path_factory.mktemp("task-runs")
    made = {}

    def get(task: str, fused: bool, group_order_clip: bool = False):
        key = (task, fused, group_order_clip)
        if key not in made:
            trainer = STOCK_LOSS[task] if fused else None
            if group_order_clip:
                trainer = _group_order_clip(STOCK_TRAINERS[task])
            made[key] = _train(task, datasets[task], project, trainer)
        return made[key]

    return get


@pytest.mark.cpu_training
@pytest.mark.parametrize("task", list(MODELS))
def test_each_task_trains_with_the_fused_optimizer_phase_exactly_like_stock(runs, task):
    (stock, stock_losses), (fused, fused_losses) = runs(task, False, task in CLIPS), runs(task, True)
    trainer = fused.trainer
    assert isinstance(trainer, TRAINERS[task])
    assert isinstance(trainer.optimizer, trainfuse.FusedAdamW) and trainer.fused_reason == ""
    assert isinstance(trainer.ema, trainfuse.FusedEMA)
    assert len(fused_losses) == len(stock_losses) == 4
    tol = {"rtol": 0, "atol": 0}
    torch.testing.assert_close(fused_losses, stock_losses, **tol)
    assert fused_losses[0] == stock_losses[0]  # before any step: the same model, batch and loss
    assert trainer.ema.updates == stock.trainer.ema.updates
    sa, sb = trainer.ema.ema.state_dict(), stock.trainer.ema.ema.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
    assert trainer.metrics == stock.trainer.metrics  # the task's own validator, from the kept batches
    kept = {(r.kind, r.name): r for r in trainer.report}[("device cache", "validation batches")]
    assert kept.action == "on"
    rows = {r.kind: r for r in trainer.report}
    validator = {"segment": "SegmentationValidator", "pose": "PoseValidator", "obb": "OBBValidator",
                 "classify": "ClassificationValidator"}[task]
    assert rows["validator"].action == "skipped"
    assert rows["validator"].detail.startswith(f"ultralytics' own {validator} validates the {task!r} run")
    if task in FUSED_LOSSES:
        assert rows["loss"].action == "off"
        assert rows["loss"].detail == f"fused_loss=False (fused_loss=True trains with {FUSED_LOSSES[task]})"
    else:
        assert rows["loss"].action == "skipped"
        assert rows["loss"].detail.startswith("ClassificationModel keeps ultralytics' cross-entropy")


def test_segment_pose_and_obb_train_with_their_fused_losses_by_default():
    assert all(t.fused_loss is True for t in (FusedSegmentationTrainer, FusedPoseTrainer, FusedOBBTrainer))


@pytest.mark.cpu_training
@pytest.mark.parametrize("task", list(FUSED_LOSSES))
def test_segment_pose_and_obb_train_with_their_fused_losses_like_stock(runs, datasets, task, tmp_path):
    stock, stock_losses = runs(task, False)
    trainer_cls = {"segment": FusedSegmentationTrainer, "pose": FusedPoseTrainer,
                   "obb": FusedOBBTrainer}[task]
    fused, fused_losses = _train(task, datasets[task], tmp_path, trainer_cls)
    rows = {r.kind: r for r in fused.trainer.report}
    assert rows["loss"].action == "swapped" and rows["loss"].detail.startswith(FUSED_LOSSES[task])
    assert isinstance(fused.trainer.train_loader.collate_fn, PadTargets)  # labels padded by the loader
    assert type(fused.trainer.model.criterion).__name__ != FUSED_LOSSES[task]  # ultralytics' own again
    # the fused losses round differently (float32 throughout, the DFL expectation a sum): close, not equal
    torch.testing.assert_close(fused_losses, stock_losses, rtol=1e-3, atol=1e-5)
    assert fused.trainer.ema.updates == stock.trainer.ema.updates


YOLO26 = {"segment": ("yolo26n-seg.yaml", "FusedE2ESegment26Loss"),
          "pose": ("yolo26n-pose.yaml", "FusedE2EPose26Loss"), "obb": ("yolo26n-obb.yaml", "FusedE2EOBBLoss")}


@pytest.mark.cpu_training
@pytest.mark.parametrize("task", list(YOLO26))
def test_yolo26_heads_train_with_their_fused_e2e_losses_like_stock(datasets, task, tmp_path):
    """YOLO26's end-to-end heads (no DFL; a semantic branch for segmentation, the RLE term for pose):
    E2ELoss over SegmentLoss26, PoseLoss26 and v8OBBLoss against the fused losses the trainers
    install, the labels padded by the loader."""
    model_file, loss = YOLO26[task]
    trainer_cls = {"segment": FusedSegmentationTrainer, "pose": FusedPoseTrainer,
                   "obb": FusedOBBTrainer}[task]
    stock, stock_losses = _train(task, datasets[task], tmp_path, model_file=model_file)
    fused, fused_losses = _train(task, datasets[task], tmp_path, trainer_cls, model_file=model_file)
    rows = {r.kind: r for r in fused.trainer.report}
    assert rows["loss"].action == "swapped" and rows["loss"].detail.startswith(loss)
    assert isinstance(fused.trainer.train_loader.collate_fn, PadTargets)
    torch.testing.assert_close(fused_losses, stock_losses, rtol=1e-3, atol=1e-5)
    assert fused.trainer.ema.updates == stock.trainer.ema.updates


@pytest.mark.cpu_training
@pytest.mark.parametrize("task", list(MODELS))
def test_each_tasks_checkpoint_loads_validates_and_predicts_with_stock_yolo(runs, datasets, task, tmp_path):
    fused, _ = runs(task, True)
    model = YOLO(str(fused.trainer.last))
    assert model.task == task
    imgsz = 64 if task != "classify" else 32
    metrics = model.val(data=datasets[task], imgsz=imgsz, batch=4, device="cpu", workers=0, plots=False,
                        verbose=False, project=str(tmp_path), name="val")
    assert metrics.fitness is not None
    root = Path(datasets[task]) if task == "classify" else Path(datasets[task]).parent
    image = next(p for p in sorted(root.rglob("*.jpg")) if "val" in p.parts)
    (result,) = model.predict(str(image), imgsz=imgsz, device="cpu", verbose=False, project=str(tmp_path))
    what = {"segment": "masks", "pose": "keypoints", "obb": "obb", "classify": "probs"}[task]
    assert hasattr(result, what)


@pytest.mark.cpu_training
@pytest.mark.parametrize("concat", ["0", "1"], ids=["blocks", "concat-in-place"])
@pytest.mark.parametrize("task", list(MODELS))
def test_each_task_trains_with_fused_blocks_as_without_and_saves_stock_checkpoints(
        runs, datasets, task, concat, tmp_path, monkeypatch):
    """``fuse_blocks=True`` on every task's model (on CPU the op's torch path, what a Conv block
    computes): the run of the fused trainer without it, bit for bit with the concatenations kept
    (``TRAINFUSE_FUSE_CONCAT=0``), to float32's roundings with them written in place (a branch read
    twice has its two grads added in another order); the modules given back; the checkpoint a
    stock ``YOLO`` loads, with the run's weights."""
    monkeypatch.setenv("TRAINFUSE_FUSE_CONCAT", concat)
    plain, plain_losses = runs(task, True)
    trainer_cls = type(f"Blocks{STOCK_LOSS[task].__name__}", (STOCK_LOSS[task],), {"fuse_blocks": True})
    ours, losses = _train(task, datasets[task], tmp_path, trainer_cls)
    rows = {r.kind: r for r in ours.trainer.report}
    count = sum(type(m).__name__ == "Conv" for m in ours.trainer.model.modules())
    assert rows["blocks"].action == "on" and rows["blocks"].detail.startswith(f"{count} Conv blocks")
    assert ("written into its slice of the concatenation" in rows["blocks"].detail) == (concat == "1")
    assert not any("forward" in m.__dict__ for m in ours.trainer.model.modules())  # given back
    exact = concat == "0"
    if exact:
        assert torch.equal(torch.stack(losses), torch.stack(plain_losses))
    else:
        torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses), rtol=1e-4, atol=1e-6)
    loaded = YOLO(str(ours.trainer.last)).model.state_dict()
    reference = YOLO(str(plain.trainer.last)).model.state_dict()
    assert loaded.keys() == reference.keys()
    if exact:
        for k in loaded:
            assert torch.equal(loaded[k], reference[k]), k
    else:  # the float32 weights in memory (the checkpoint's float16 rounds their differences up)
        trained, want = ours.trainer.model.state_dict(), plain.trainer.model.state_dict()
        off = total = 0
        for k, b in want.items():
            a = trained[k].double()
            gap = (a - b.double()).abs()
            # AdamW turns a rounding in a grad near zero into up to its whole step (lr0 = 0.002)
            assert gap.numel() == 0 or float(gap.max()) <= 0.002, k
            off += int((gap > 1e-6 + 1e-4 * b.double().abs()).sum())
            total += gap.numel()
        assert off <= 1e-3 * total, f"{off} of {total} weights differ beyond float32's roundings"


@pytest.mark.parametrize("model,expected", [
    ("yolov5n.yaml", FusedDetectionTrainer), ("yolo11n-seg.yaml", FusedSegmentationTrainer),
    ("yolo26n-pose.yaml", FusedPoseTrainer), ("yolo11n-obb.pt", FusedOBBTrainer),
    ("yolov8n-cls.yaml", FusedClassificationTrainer), ("classify", FusedClassificationTrainer)])
def test_trainer_for_picks_the_trainer_of_the_models_task(model, expected):
    assert trainer_for(model) is expected


def test_trainer_for_takes_a_yolo_object_and_refuses_tasks_without_a_fused_trainer():
    assert trainer_for(YOLO("yolov8n-seg.yaml")) is FusedSegmentationTrainer
    with pytest.raises(ValueError, match=r"trainer_for: no fused trainer trains task 'depth'"):
        trainer_for("depth")


@pytest.mark.parametrize("task", list(TRAINERS))
def test_a_task_trainer_refuses_another_tasks_model_naming_the_right_trainer(datasets, task, tmp_path):
    other = "detect" if task != "detect" else "segment"
    model = "yolov5n.yaml" if other == "detect" else MODELS[other]
    expected = (rf"{TRAINERS[task].__name__} trains task '{task}'; this run's task is '{other}' .*train it "
                "with FusedDetectionTrainer")
    with pytest.raises(ValueError, match=expected):
        YOLO(model).train(trainer=TRAINERS[task], data=datasets["segment"], epochs=1, imgsz=64, device="cpu",
                          project=str(tmp_path), plots=False)


def test_the_task_datasets_hold_exact_labels_in_ultralytics_layouts(datasets):
    seg = Path(datasets["segment"]).parent
    for line in (seg / "labels" / "train" / "00000.txt").read_text().splitlines():
        values = line.split()
        assert int(values[0]) < len(CLASSES["segment"]) and len(values) % 2 == 1 and len(values) >= 7
        assert all(0.0 <= float(v) <= 1.0 for v in values[1:])
    pose = Path(datasets["pose"])
    yaml = pose.read_text()
    assert f"kpt_shape: {list(KPT_SHAPE)}" in yaml and f"flip_idx: {list(FLIP_IDX)}" in yaml
    for line in (pose.parent / "labels" / "train" / "00000.txt").read_text().splitlines():
        values = [float(v) for v in line.split()]
        assert len(values) == 5 + KPT_SHAPE[0] * KPT_SHAPE[1]
        kpts = torch.tensor(values[5:]).view(KPT_SHAPE)
        assert set(kpts[:, 2].tolist()) <= {1.0, 2.0}
        xc, yc, w, h = values[1:5]  # the box is the keypoints' extent
        assert kpts[:, 0].min().item() == pytest.approx(xc - w / 2, abs=2e-6)
        assert kpts[:, 1].max().item() == pytest.approx(yc + h / 2, abs=2e-6)
    obb = Path(datasets["obb"]).parent
    for line in (obb / "labels" / "train" / "00000.txt").read_text().splitlines():
        corners = torch.tensor([float(v) for v in line.split()[1:]]).view(4, 2) * 64
        sides = (corners - corners.roll(1, 0)).norm(dim=1)
        torch.testing.assert_close(sides[0], sides[2], rtol=0, atol=1e-3)  # a rectangle
    classify = Path(datasets["classify"])
    assert sorted(p.name for p in (classify / "train").iterdir()) == sorted(CLASSES["classify"])
    assert all(len(list(folder.glob("*.jpg"))) <= 8 for folder in (classify / "train").iterdir())


def test_make_task_dataset_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"make_task_dataset: task='depth'; expected one of"):
        make_task_dataset(tmp_path, "depth")
    with pytest.raises(ValueError, match=r"make_task_dataset: nc=2 for task 'pose'; expected 1 to 1"):
        make_task_dataset(tmp_path, "pose", nc=2)
