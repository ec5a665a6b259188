"""Fixtures the loss tests share (the kernels' small blocks, garbage-filled outputs, the
kernel-or-torch path), the augmentation tests' stock loader that decodes as the GPU does, and the
CPU augmentation for every test that does not ask for the GPU's."""

from __future__ import annotations

import pytest
import torch

from trainfuse.losses.detection import sums


@pytest.fixture(autouse=True)
def cpu_augmentation_unless_asked(request, monkeypatch):
    """The trainer tests compare FusedDetectionTrainer's runs with stock ultralytics', whose
    augmentation runs on the CPU, and nvJPEG decodes a few levels apart from OpenCV. So in this
    process the trainer keeps the CPU augmentation unless a test asks for the GPU's
    (``gpu_augment=True``) or for the trainer's own default (``@pytest.mark.gpu_augment_default``).
    DDP ranks rebuild the trainer from its class in processes of their own: they keep the default
    (on CUDA, the GPU augmentation for images read from disk)."""
    if request.node.get_closest_marker("gpu_augment_default") is None:
        try:
            from trainfuse.ultralytics import FusedDetectionTrainer
        except ImportError:  # no ultralytics: its tests skip
            return
        monkeypatch.setattr(FusedDetectionTrainer, "gpu_augment", False)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks small enough that the interpreter runs several programs on a 64 px image."""
    for name, value in (("box", 64), ("assign", 64), ("scores", 64), ("cls", 64)):
        monkeypatch.setattr(sums.blocks, name, value)


@pytest.fixture
def garbage_empty(monkeypatch):
    """``torch.empty`` and ``torch.empty_like`` filled with garbage (NaN, 0x5A bytes in integers,
    a huge index in int32): an output element that no kernel program writes shows up."""
    fills = {1: 0x5A, 2: 0x5A5A, 4: 0x5A5A5A5A, 8: 0x5A5A5A5A5A5A5A5A}

    def garbage(make):
        def filled(*args, **kwargs):
            out = make(*args, **kwargs)
            if out.dtype != torch.bool:
                out.fill_(float("nan") if out.is_floating_point() else fills[out.element_size()])
            return out
        return filled

    monkeypatch.setattr(torch, "empty", garbage(torch.empty))
    monkeypatch.setattr(torch, "empty_like", garbage(torch.empty_like))


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch):
    """The Triton kernels (the interpreter on CPU) or the dense torch path."""
    if request.param == "kernels":
        request.getfixturevalue("kernels")
        request.getfixturevalue("small_blocks")
    else:
        monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    return request.param


@pytest.fixture
def stock_decodes_as_the_gpu(monkeypatch):
    """A call ``(on)`` that, when ``on``, has ultralytics' image reader decode JPEGs as the GPU
    augmentation's decoder does on CUDA (nvJPEG through torchvision): a stock batch then differs
    from a deferred one only by the augmentation. Decoders may differ (nvJPEG's chroma upsampling
    and IDCT are not libjpeg-turbo's), so a JPEG's pixels are the decoder's business, not the
    augmentation's. Off, stock reads with OpenCV (libjpeg-turbo, as torchvision on the CPU)."""
    import numpy as np
    from torchvision.io import ImageReadMode, decode_jpeg
    from ultralytics.data import base

    stock = base.imread
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def imread(filename, flags=None):
        if not str(filename).lower().endswith((".jpg", ".jpeg")):
            return stock(filename) if flags is None else stock(filename, flags=flags)
        data = torch.from_numpy(np.fromfile(str(filename), np.uint8))
        rgb = decode_jpeg([data], mode=ImageReadMode.RGB, device=device)[0]
        return np.ascontiguousarray(rgb.flip(0).permute(1, 2, 0).cpu().numpy())

    def switch(on: bool) -> None:
        if on:
            monkeypatch.setattr(base, "imread", imread)

    return switch
