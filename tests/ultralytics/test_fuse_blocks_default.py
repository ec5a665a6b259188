"""Where the fused trainers' ``fuse_blocks`` default (None) fuses the model's blocks
(trainfuse.ultralytics.changes.blocks.why_off): detection models of 5M parameters or more on one
CUDA device, where it was measured; True fuses them anywhere, False nowhere. The real runs with
the blocks fused are in test_trainer.py and test_graphed.py."""

from __future__ import annotations

import tempfile
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from trainfuse.ultralytics.changes import blocks  # noqa: E402


def _run(device: str, task: str, world_size: int, params: int):
    """What ``why_off`` reads of a run: its device, the trainer's task and world size, the model's
    parameters (a model of ``params``)."""
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(task=task), world_size=world_size)
    model = nn.Linear(params // 1000, 1000, bias=False, device="meta")
    return types.SimpleNamespace(device=torch.device(device), trainer=trainer, model=model)


M = 1_000_000
SMALL = ("fuse_blocks defaults to on for models of 5M parameters or more (this one has 2.6M: its step is not "
         "bound by these kernels; True turns it on)")


@pytest.mark.parametrize(("setting", "device", "task", "world_size", "params", "off"), [
    (None, "cuda", "detect", 1, 9 * M, None),
    (None, "cuda", "detect", 1, 5 * M, None),
    (None, "cuda", "detect", 1, 2_600_000, SMALL),
    (None, "cpu", "detect", 1, 9 * M, "fuse_blocks defaults to on for CUDA devices only (True runs the torch "
                                      "reference here)"),
    (None, "cuda", "segment", 1, 9 * M, "fuse_blocks defaults to on for detection models only (True turns it "
                                        "on for this segment model)"),
    (None, "cuda", "detect", 2, 9 * M, "fuse_blocks defaults to off under DDP (True turns it on)"),
    (True, "cpu", "classify", 2, 2 * M, None),
    (True, "cuda", "detect", 1, 2 * M, None),
    (False, "cuda", "detect", 1, 9 * M, "fuse_blocks=False"),
])
def test_the_default_fuses_larger_detection_models_on_one_cuda_device(setting, device, task, world_size,
                                                                       params, off):
    assert blocks.why_off(setting, _run(device, task, world_size, params)) == off


def test_the_threshold_splits_ultralytics_nano_models_from_the_small_ones():
    """The parameter counts the threshold stands between, as ultralytics builds the models."""
    from ultralytics.nn.tasks import DetectionModel

    def count(cfg: str) -> int:
        return sum(p.numel() for p in DetectionModel(cfg, nc=80, verbose=False).parameters())

    nano = max(count("yolov5n.yaml"), count("yolo11n.yaml"), count("yolo26n.yaml"))
    assert nano < blocks.DEFAULT_MIN_PARAMS < count("yolo11s.yaml")
