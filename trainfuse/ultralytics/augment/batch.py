"""The GPU's side of the deferred augmentation: a batch of :class:`~trainfuse.ultralytics.augment.
deferred.DeferredCollate` made into the batch ultralytics' own collate would have made.

:func:`finish_batch` runs on the batch's device, without a host sync: one kernel for the images
(:func:`~trainfuse.ultralytics.augment.kernel.augment_images`), a few small ops for the labels:
the boxes warped, clipped and filtered by ultralytics' box-candidate rule (area ratio 0.10, sides
over 2 px, aspect under 100), flipped, and normalized to ``xywh``. A box the rule drops keeps its
row as zeros (class 0, box 0), instead of leaving the batch: counting the survivors would need the
host. ultralytics' losses, and trainfuse's, ignore a zero box (their ``mask_gt`` is a positive
coordinate sum), so the loss is the one of the filtered labels; the padded labels are built here
from these rows, with the capacity the workers counted before the filter.
"""

from __future__ import annotations

import torch

from trainfuse.ultralytics.augment.geometry import box_candidates, warp_boxes
from trainfuse.ultralytics.augment.kernel import augment_images
from trainfuse.ultralytics.augment.params import AffineParams
from trainfuse.ultralytics.targets import PADDED_KEY, pad_targets

PACKED_KEY = "aug_packed"


def is_deferred(batch: dict) -> bool:
    """Whether ``batch`` still waits for :func:`finish_batch`."""
    return PACKED_KEY in batch


def finish_batch(batch: dict) -> dict:
    """Warp, colour-jitter and flip the deferred ``batch``'s images and labels where its tensors are
    (the device), in place: ``img`` (N, 3, H, W) uint8, ``bboxes`` normalized ``xywh``, ``cls``,
    ``batch_idx`` and, where the workers counted a capacity, the padded labels. Returns ``batch``."""
    size, perspective = batch.pop("aug_size"), batch.pop("aug_perspective")
    vector_block = batch.pop("aug_vector_block")
    capacity = batch.pop("aug_capacity")
    scale = batch.pop("aug_scale")
    matrix = batch.pop("aug_matrix")
    flips = batch.pop("aug_flips")
    batch["img"] = augment_images(batch.pop(PACKED_KEY), batch.pop("aug_starts"), batch.pop("aug_dims"),
                                  batch.pop("aug_inverse"), batch.pop("aug_origins"), flips,
                                  batch.pop("aug_luts"), batch.pop("aug_swaps"), size, perspective, vector_block)
    n = batch["img"].shape[0]
    index = batch["batch_idx"].reshape(-1).long()
    before = batch["bboxes"]
    after = warp_boxes(before, index, AffineParams(matrix, scale, size, perspective))
    keep = box_candidates(before, after, scale[index]) if before.numel() else index.new_zeros(0, dtype=torch.bool)
    w, h = size
    x1, y1, x2, y2 = after.unbind(1)
    vertical, horizontal = flips[index, 0], flips[index, 1]
    x1, x2 = torch.where(horizontal, w - x2, x1), torch.where(horizontal, w - x1, x2)
    y1, y2 = torch.where(vertical, h - y2, y1), torch.where(vertical, h - y1, y2)
    xywh = torch.stack(((x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h), 1)
    keep = keep.view(-1, 1)
    batch["bboxes"] = torch.where(keep, xywh, 0.0).to(before.dtype)
    batch["cls"] = torch.where(keep, batch["cls"], 0.0)
    if capacity is not None:
        batch[PADDED_KEY] = pad_targets(index, batch["cls"], batch["bboxes"], n, capacity)
    return batch


__all__ = ["PACKED_KEY", "finish_batch", "is_deferred"]
