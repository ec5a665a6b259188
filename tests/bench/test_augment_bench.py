"""The augmentation benchmark's pieces on the CPU: its batch of mosaic-sized crops, ultralytics'
CPU transforms on it (the anchor), and the kernel's inputs built from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ultralytics")
pytest.importorskip("cv2")

from trainfuse.bench.augment import _batch, _cpu_ms, _packed  # noqa: E402
from trainfuse.ultralytics.augment.kernel import augment_images_reference  # noqa: E402


def test_crops_are_what_a_warp_of_the_default_scale_reads():
    batch = _batch(8, 64)
    for crop, m in zip(batch["crops"], batch["matrices"]):
        s = m[0, 0]
        assert 0.5 <= s <= 1.5 and crop.shape[0] == crop.shape[1] == min(128, int(np.ceil(64 / s)) + 2)
        centre = m @ np.array([crop.shape[1] / 2, crop.shape[0] / 2, 1.0])
        assert 0.4 * 64 <= centre[0] <= 0.6 * 64  # ultralytics' translate=0.1 around the middle
    assert batch["luts"].shape == (8, 3, 256) and batch["luts"].dtype == torch.uint8


def test_the_anchor_and_the_reference_run_on_the_batch():
    batch = _batch(2, 32)
    assert _cpu_ms(batch, 32, repeats=1) > 0
    packed, table = _packed(batch)
    assert packed.numel() == sum(c.size for c in batch["crops"])
    out = augment_images_reference(packed, table, batch["luts"], (32, 32))
    assert out.shape == (2, 3, 32, 32) and (out != 114).any()
