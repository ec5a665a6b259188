"""The Triton kernels the fused blocks (:mod:`trainfuse.ultralytics.changes.blocks`) launch in a
model's training step, listed without a GPU, for compiling them ahead.

On a machine whose Triton cache is empty, each specialization compiles at its first launch, inside
the first iterations, one after another: a second or two apiece for the BatchNorm kernels. The
trainer's compile workers (:class:`~trainfuse.ultralytics.warm_start.KernelsAhead`) compile a
manifest of them in parallel while ultralytics sets the run up. :func:`step_entries` lists a
model's by running its fused forward and backward on the meta device with the launches recorded
instead of run (:func:`trainfuse._runtime.launch.dry_launches`): ultralytics' default 640 px and
batch 16, the convolutions in float16 as the trainer's casts make them under AMP and their outputs
in channels_last as cuDNN keeps them, two backward passes (the BatchNorm grads assigned, then
accumulated). ``python -m trainfuse.ultralytics.block_kernels`` writes the shipped manifest
(:data:`MANIFEST`) for the models the trainers fuse by default.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
from ultralytics.nn.tasks import DetectionModel

from trainfuse._runtime import precompile
from trainfuse._runtime.launch import dry_launches
from trainfuse.ultralytics.changes import blocks, upsample
from trainfuse.ultralytics.warm_start import BLOCKS_MANIFEST as MANIFEST  # manifests/<MANIFEST>.json

# the detection models whose blocks the trainers fuse by default (5M parameters and more)
MODELS = ("yolo11s.yaml", "yolo11m.yaml", "yolo11l.yaml", "yolo11x.yaml", "yolov8s.yaml", "yolov8m.yaml",
          "yolov8l.yaml", "yolo26s.yaml", "yolo26m.yaml", "yolo26l.yaml")


@contextlib.contextmanager
def _kernels_on_meta():
    """The ops' Triton path for meta tensors: the backend forced, and the device taken as the
    interpreter's (whose launches :func:`dry_launches` stops before they run)."""
    saved = {k: os.environ.get(k) for k in ("TRAINFUSE_BACKEND", "TRITON_INTERPRET")}
    os.environ.update(TRAINFUSE_BACKEND="triton", TRITON_INTERPRET="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _channels_last(module, inputs, out):
    return out.contiguous(memory_format=torch.channels_last)


def _predictions(out) -> list[torch.Tensor]:
    """The tensors a detection loss takes grads through from a model's training output (dicts of
    ``boxes`` and ``scores``, one per head branch: its ``feats`` give the loss their shapes only)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k, v in out.items() if k != "feats" for t in _predictions(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _predictions(v)]
    return []


def step_entries(cfg: str, imgsz: int = 640, batch: int = 16, backwards: int = 2) -> list[dict]:
    """The manifest entries of a training step of detection model ``cfg`` (a YAML ultralytics
    builds) with its blocks fused: ``backwards`` backward passes after one forward each."""
    model = DetectionModel(cfg, nc=80, verbose=False).train()
    blocks.fuse_model(model, True)
    upsample.install(model)
    model = model.to("meta").to(memory_format=torch.channels_last)
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.half()  # the casts' float16 weights; BatchNorm stays float32
            m.register_forward_hook(_channels_last)
    x = torch.empty(batch, 3, imgsz, imgsz, device="meta", dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    with _kernels_on_meta(), dry_launches() as entries:
        for _ in range(backwards):
            out = model(x)
            sum(o.float().sum() for o in _predictions(out)).backward()
    return entries


def write(models: tuple[str, ...] = MODELS, path: Path | None = None) -> Path:
    """Write the shipped manifest of ``models``' step entries (their union) to ``path`` (default:
    the package's :data:`MANIFEST`)."""
    path = path or Path(precompile.__file__).with_name("manifests") / f"{MANIFEST}.json"
    entries: list[dict] = []
    for cfg in models:
        entries += [e for e in step_entries(cfg) if e not in entries]
    precompile.save(path, entries)
    return path


if __name__ == "__main__":
    written = write(tuple(sys.argv[1:]) or MODELS)
    print(f"wrote {written} ({len(precompile.load(written))} entries)")

__all__ = ["MANIFEST", "MODELS", "step_entries", "write"]
