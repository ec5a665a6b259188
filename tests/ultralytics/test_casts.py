"""FusedDetectionTrainer's cast fusion (AMP on CUDA): 16-bit weights with float32 masters, stock
checkpoints, resume, and ultralytics' NaN recovery path. GPU only: ultralytics turns AMP off on CPU,
and with it the casts (checked on CPU below)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics import YOLO  # noqa: E402
from ultralytics.utils.torch_utils import unwrap_model  # noqa: E402

from tests._helpers import cuda  # noqa: E402
from trainfuse.optim import MASTER_KEY  # noqa: E402
from trainfuse.ultralytics import FusedDetectionTrainer  # noqa: E402
from trainfuse.ultralytics.shapes import make_shapes_dataset  # noqa: E402


class Float32Trainer(FusedDetectionTrainer):
    """Everything fused but the casts: the reference of the cast run."""

    fuse_casts = False


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("shapes")
    return str(make_shapes_dataset(root, n_train=16, n_val=8, imgsz=64, seed=0))


def _train(data, project, trainer, device, resume=None, epochs=2, at_end=None):
    """A run (or a resume); returns the trainer, what each iteration saw and the checkpoint of
    epoch 1 with its optimizer state (the final last.pt has it stripped). ``at_end(trainer, seen)``
    runs in ``on_train_end``, while the trainer's changes are still made."""
    model = YOLO(str(resume) if resume else "yolov5n.yaml")
    name = trainer.__name__ if trainer else "stock"
    seen = {"losses": [], "dtypes": set(), "mid": Path(project) / f"mid-{name}.pt"}

    def record(t):
        seen["losses"].append(float(t.loss.detach()))
        seen["dtypes"].add(unwrap_model(t.model).model[0].conv.weight.dtype)

    def keep_first_checkpoint(t):
        if t.epoch == 0 and not resume:
            shutil.copyfile(t.last, seen["mid"])

    model.add_callback("on_train_batch_end", record)
    model.add_callback("on_model_save", keep_first_checkpoint)
    if at_end is not None:
        model.add_callback("on_train_end", lambda t: at_end(t, seen))
    if resume:
        model.train(resume=True, save_dir=str(Path(project) / f"resumed-{Path(resume).stem}"),
                    trainer=trainer)
    else:
        model.train(data=data, epochs=epochs, imgsz=64, batch=4, nbs=8, workers=0, device=device, plots=False,
                    val=False, seed=0, deterministic=True, verbose=False, optimizer="AdamW",
                    project=str(project), name=trainer.__name__, exist_ok=True, trainer=trainer)
    return model.trainer, seen


@pytest.mark.cpu_training
def test_no_casts_without_amp_on_cpu(data, tmp_path):
    trainer, seen = _train(data, tmp_path, FusedDetectionTrainer, "cpu", epochs=1)
    assert seen["dtypes"] == {torch.float32}
    assert {r.kind: r.action for r in trainer.report}["casts"] == "off"


def _check_casts_and_reload(ours, seen) -> None:
    """At the end of the cast run, its changes still made: 16-bit weights with float32 masters, a
    stock checkpoint, and ultralytics' NaN-recovery load (weights loaded into the 16-bit model,
    then ``_load_checkpoint_state``) making the casts again from the loaded weights."""
    model = unwrap_model(ours.model)
    bn = model.model[0].bn
    assert bn.weight.dtype == torch.float32  # BatchNorm stays float32
    conv = model.model[0].conv.weight
    master = ours.optimizer.state[conv][MASTER_KEY]
    assert master.dtype == torch.float32 and torch.equal(master.half(), conv)

    # stock checkpoint: torch.optim's layout (no masters), a float32 EMA saved as ultralytics saves it
    ckpt = torch.load(seen["mid"], weights_only=False)
    states = ckpt["optimizer"]["state"].values()
    assert states and all(MASTER_KEY not in s for s in states)
    assert all("master_weights" not in g for g in ckpt["optimizer"]["param_groups"])
    assert ckpt["ema"].model[0].conv.weight.dtype == torch.float16  # ultralytics' .half(), as stock

    # ultralytics' NaN recovery path mid-run: weights loaded into the 16-bit model, then this
    ema_weights = ckpt["ema"].float().state_dict()
    model.load_state_dict(ema_weights)
    ours._load_checkpoint_state(ckpt)
    assert conv.dtype == torch.float16
    assert {r.kind: r.action for r in ours.report}["casts"] == "on"
    assert ours.ema.ema.model[0].conv.weight.dtype == torch.float32
    master = ours.optimizer.state[conv][MASTER_KEY]
    assert torch.equal(master, ema_weights["model.0.conv.weight"].to(master.device))
    seen["checked"] = True


@cuda
def test_cast_run_checkpoint_resume_and_nan_recovery(data, tmp_path):
    ours, seen = _train(data, tmp_path, FusedDetectionTrainer, "0", at_end=_check_casts_and_reload)
    ref, ref_seen = _train(data, tmp_path, Float32Trainer, "0")
    assert seen["dtypes"] == {torch.float16} and ref_seen["dtypes"] == {torch.float32}
    # the first forward reads the same float16 weights autocast makes; later iterations differ in
    # the last bits (16-bit grad sums), which these 64-pixel runs amplify through the assigner's
    # discrete choices within a few steps: quality is compared by `python -m trainfuse.bench yolo`
    assert seen["losses"][0] == ref_seen["losses"][0]
    assert all(torch.isfinite(torch.tensor(seen["losses"])))
    assert seen.get("checked")
    # after training the weights are float32 again, as stock leaves them
    assert all(p.dtype == torch.float32 for p in unwrap_model(ours.model).parameters())

    # resume from the epoch-1 checkpoint: stock ultralytics and this trainer
    for trainer in (None, FusedDetectionTrainer):
        copy = tmp_path / f"resume-{trainer.__name__ if trainer else 'stock'}.pt"
        shutil.copyfile(seen["mid"], copy)
        resumed, rseen = _train(data, tmp_path, trainer, "0", resume=copy)
        assert resumed.start_epoch == 1 and len(rseen["losses"]) == 4
        assert all(torch.isfinite(torch.tensor(rseen["losses"])))
        assert rseen["dtypes"] == ({torch.float16} if trainer else {torch.float32})
