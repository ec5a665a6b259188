"""The training images handed to the model as the uint8 batch (``raw_images=True``): its
first convolution makes its input from them in one kernel (:mod:`trainfuse.nn.image_input`: ``x /
255`` in the dtype and layout it computes in, folded as it reads them where the stem is folded),
where ultralytics' ``preprocess_batch`` makes them float32 first (two passes, four bytes written
for each read) and the convolution casts and re-lays them. The convolution gets stock's numbers
bit for bit; in CUDA graphs the replay's input copy moves a quarter of the bytes.

Off with ``compile``, with ``multi_scale`` (which resizes the float images), where a class of the
trainer other than trainfuse's and ultralytics' ``DetectionTrainer`` defines ``preprocess_batch``
(it may read the float images), and where the model's first layer is not an ultralytics ``Conv`` on
the image (its convolution a plain ``nn.Conv2d``).
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override
from ultralytics.models.yolo.detect import DetectionTrainer
from ultralytics.nn.modules.conv import Conv

from trainfuse.clients import ON, Row
from trainfuse.nn import image_input, stem
from trainfuse.ultralytics.changes.base import Change, Run


def first_conv(model: nn.Module) -> nn.Module | None:
    """The convolution that reads ``model``'s input: its first layer's, where that layer is an
    ultralytics ``Conv`` (its class's forward, which convolves the input first) on the image; else
    None."""
    layers = getattr(model, "model", None)
    first = layers[0] if isinstance(layers, nn.Sequential) and len(layers) else None
    if not isinstance(first, Conv) or type(first).forward is not Conv.forward:
        return None
    if getattr(first, "f", None) != -1:  # reads another layer's output, not the image
        return None
    conv = first.conv
    return conv if type(conv) is nn.Conv2d else None


def preprocess_owner(trainer) -> type | None:
    """The class whose ``preprocess_batch`` the trainer's runs after trainfuse's: the first class in
    its MRO outside trainfuse that defines one."""
    return next((c for c in type(trainer).__mro__ if "preprocess_batch" in c.__dict__
                 and not c.__module__.startswith("trainfuse.")), None)


def device_batch(batch: dict, device: torch.device) -> dict:
    """``batch``'s tensors moved to ``device`` as ultralytics' ``preprocess_batch`` moves them, the
    images left uint8."""
    blocking = device.type in {"cpu", "mps"}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            batch[k] = v.to(device, non_blocking=not blocking)
    return batch


class ImageInput(Change):
    """The model's first convolution takes the uint8 batch (module docstring)."""

    kind = "input"

    def __init__(self, on: bool) -> None:
        self.on = on
        self._conv: nn.Module | None = None  # the convolution given image_input's forward

    @override
    def name(self, run: Run) -> str:
        return "images"

    @override
    def why_off(self, run: Run) -> str | None:
        return None if self.on else "raw_images=False"

    @override
    def why_not(self, run: Run) -> str | None:
        args = run.trainer.args
        if args.compile:
            return "compile is on (it traces ultralytics' preprocessing)"
        if args.multi_scale:
            return f"multi_scale={args.multi_scale} resizes the float images"
        owner = preprocess_owner(run.trainer)
        if owner is not DetectionTrainer:
            return (f"{getattr(owner, '__name__', None)}.preprocess_batch may read the float images (the "
                    "uint8 batch goes only where DetectionTrainer's preprocessing runs)")
        conv = first_conv(run.model)
        if conv is None:
            return (f"the model's first layer ({type(run.model.model[0]).__name__}) is not an ultralytics "
                    "Conv with a plain Conv2d on the image")
        if not stem.installed(conv) and not image_input.takes_images(conv):
            return "the first convolution has a forward of its own already"
        return None

    @override
    def apply(self, run: Run) -> None:
        conv = first_conv(run.model)
        if not stem.installed(conv):  # the folded stem takes uint8 images itself
            image_input.install(conv)
            self._conv = conv
        run.uint8_images = True

    @override
    def rows(self, run: Run) -> list[Row]:
        conv = first_conv(run.model)
        how = "folded for the stem as it is read" if stem.installed(conv) else "in the convolution's layout"
        return [Row(self.kind, self.name(run), ON, "the training batches reach the model as uint8 images; "
                    "its first convolution makes its input from them in one kernel (x / 255 in its dtype, "
                    f"{how}; stock's values)")]

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        run.uint8_images = False
        if self._conv is not None:
            image_input.uninstall(self._conv)
            self._conv = None


__all__ = ["ImageInput", "device_batch", "first_conv", "preprocess_owner"]
