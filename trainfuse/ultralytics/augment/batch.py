"""The GPU's side of the deferred augmentation: the images of a batch of :class:`~trainfuse.
ultralytics.augment.deferred.DeferredCollate` warped, colour-jittered, flipped and channel-swapped
by one kernel (:func:`~trainfuse.ultralytics.augment.kernel.augment_images`), where the batch's
tensors are; its JPEGs decoded there first where the loader left them encoded
(:class:`~trainfuse.ultralytics.augment.decode.JpegDecoder`). The labels arrive final from the
loader's workers (ultralytics' own code moved them).
"""

from __future__ import annotations

from trainfuse.ultralytics.augment.decode import JpegDecoder
from trainfuse.ultralytics.augment.kernel import augment_images

TABLE_KEY = "aug_table"


def is_deferred(batch: dict) -> bool:
    """Whether ``batch`` still waits for :func:`finish_batch`."""
    return TABLE_KEY in batch


def finish_batch(batch: dict, decoder: JpegDecoder | None = None) -> dict:
    """Put the deferred ``batch``'s images in ``batch["img"]`` ((N, 3, H, W) uint8, on the device of
    its table), in place, without a host sync. Returns ``batch``.

    Args:
        batch: its tensors on the device, but for the decoder's (``aug_sources``, ``aug_jpeg``).
        decoder: decodes and keeps the batch's JPEGs (a new one, keeping nothing, when None).
    """
    if "aug_jpeg" in batch:
        decoder = decoder if decoder is not None else JpegDecoder(capacity=0)
        packed = decoder.pack(batch.pop("aug_sources"), batch.pop("aug_raw"), batch.pop("aug_jpeg"))
    else:
        packed = batch.pop("aug_packed")
    batch["img"] = augment_images(packed, batch.pop(TABLE_KEY), batch.pop("aug_luts"), batch.pop("aug_size"),
                                  batch.pop("aug_perspective"), batch.pop("aug_vector_block"))
    return batch


__all__ = ["TABLE_KEY", "finish_batch", "is_deferred"]
