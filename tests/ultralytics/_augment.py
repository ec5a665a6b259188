"""What the augmentation tests share: a batch of a dataset's samples, each drawn from its own seed,
so a stock and a deferred dataset draw the same parameters."""

from __future__ import annotations

import random

import numpy as np


def seeded_batch(dataset, seed: int, images=(0, 3, 5)) -> dict:
    """``dataset``'s collated batch of ``images``, sample ``k`` drawn after seeding Python's and
    numpy's generators with ``seed * 10 + k``."""
    samples = []
    for k, i in enumerate(images):
        random.seed(seed * 10 + k)
        np.random.seed(seed * 10 + k)
        samples.append(dataset[i])
    return dataset.collate_fn(samples)
