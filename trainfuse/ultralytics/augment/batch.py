"""The GPU's side of the deferred augmentation: the images of a batch of :class:`~trainfuse.
ultralytics.augment.deferred.DeferredCollate` warped, colour-jittered, flipped and channel-swapped
by one kernel (:func:`~trainfuse.ultralytics.augment.kernel.augment_images`), where the batch's
tensors are. The labels arrive final from the loader's workers (ultralytics' own code moved them).
"""

from __future__ import annotations

from trainfuse.ultralytics.augment.kernel import augment_images

PACKED_KEY = "aug_packed"


def is_deferred(batch: dict) -> bool:
    """Whether ``batch`` still waits for :func:`finish_batch`."""
    return PACKED_KEY in batch


def finish_batch(batch: dict) -> dict:
    """Put the deferred ``batch``'s images in ``batch["img"]`` ((N, 3, H, W) uint8, on the device of
    its packed pixels), in place, without a host sync. Returns ``batch``."""
    batch["img"] = augment_images(batch.pop(PACKED_KEY), batch.pop("aug_table"), batch.pop("aug_luts"),
                                  batch.pop("aug_size"), batch.pop("aug_perspective"),
                                  batch.pop("aug_vector_block"))
    return batch


__all__ = ["PACKED_KEY", "finish_batch", "is_deferred"]
