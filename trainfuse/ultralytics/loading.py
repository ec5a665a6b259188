"""The training batches of :class:`~trainfuse.ultralytics.FusedDetectionTrainer`: how they are built,
augmented, padded and brought to the GPU (:class:`BatchLoading`, which the trainer's
``build_dataset``, ``get_dataloader`` and ``preprocess_batch`` hand their results to).

- **GPU augmentation** (``gpu_augment``; by default on CUDA for images read from disk every epoch,
  not for ``cache="ram"``): the loader's workers read the JPEGs' bytes and move the labels; on CUDA
  the GPU decodes the JPEGs
  (:mod:`trainfuse.ultralytics.augment.decode`) and the random warp, HSV jitter and flips of the
  pixels run there, the whole batch in one kernel, with the very random parameters ultralytics'
  CPU transforms would have drawn (:mod:`trainfuse.ultralytics.augment.deferred`,
  :func:`~trainfuse.ultralytics.augment.batch.finish_batch`), where the dataset and
  hyperparameters allow it (:func:`~trainfuse.ultralytics.augment.deferred.unsupported` says when
  they do not). On a CPU device the workers decode and paste what the warp reads.
- **Padded labels**: with a fused loss, the batch carries its labels padded to a capacity the
  workers count on the CPU (no host sync in the loss).
- **Prefetch** (``prefetch``): batches copied to the GPU one ahead on a side stream, and finished
  there when their augmentation is deferred
  (:class:`~trainfuse.ultralytics.prefetch.DevicePrefetcher`).
"""

from __future__ import annotations

import functools

import torch

from trainfuse.clients import OFF, ON, Row
from trainfuse.losses.detection import PADDED_KEY, PadTargets, add_padded_targets
from trainfuse.ultralytics.prefetch import DevicePrefetcher

# why gpu_augment=None (the default) keeps the CPU augmentation
CPU_DEFAULT_REASON = ("gpu_augment defaults to on for CUDA devices only (gpu_augment=True runs its torch "
                      "path here)")
RAM_CACHE_REASON = ("the images are cached in RAM (cache='ram'): the workers keep up with the step, so "
                    "gpu_augment defaults to off (gpu_augment=True turns it on)")


def setting_keeps_cpu(gpu_augment: bool | None, device: torch.device, cache: str | None) -> str:
    """Why the ``gpu_augment`` setting keeps ultralytics' CPU augmentation on ``device`` with the
    dataset's ``cache`` (ultralytics' ``dataset.cache``: None, ``"ram"`` or ``"disk"``), before the
    dataset's own limits are asked; "" where it does not."""
    if gpu_augment is False:
        return "gpu_augment=False"
    if gpu_augment is None and device.type != "cuda":
        return CPU_DEFAULT_REASON
    if gpu_augment is None and cache == "ram":
        return RAM_CACHE_REASON
    return ""


class BatchLoading:
    """The training batches' loading (see the module), one per trainer: what it decided is in
    :attr:`augment_reason`, :attr:`jpeg_decoder` and :attr:`rows`; everything it needs comes in
    as arguments.

    Args:
        gpu_augment: True augments the training batches' pixels on the GPU where the dataset
            allows it (on a CPU device, through the torch path); False keeps ultralytics' CPU
            transforms; None is True on CUDA where the images are read from disk every epoch
            (``cache`` False or ``"disk"``) and False otherwise: with ``cache="ram"`` the workers
            neither read nor decode, keep up with the step, and the GPU's share of the
            augmentation only adds to it (:data:`RAM_CACHE_REASON`).
        prefetch: on CUDA, copy the training batches to the GPU one batch ahead on a side stream.

    Attributes:
        augment_reason: empty when the training batches are augmented on the GPU, else why not.
        jpeg_decoder: with GPU augmentation on CUDA, the
            :class:`~trainfuse.ultralytics.augment.decode.JpegDecoder` that decodes the training
            JPEGs and keeps the workers' recent ones (its ``decoded`` and ``reused`` counts); else None.
        rows: the report rows of the last training dataset built (kind ``augment``).
    """

    def __init__(self, gpu_augment: bool | None, prefetch: bool) -> None:
        self.gpu_augment = gpu_augment
        self.prefetch = prefetch
        self.augment_reason = "no training dataset yet"
        self.jpeg_decoder = None
        self.rows: list[Row] = []

    def _augment_off(self, dataset, hyp, device: torch.device) -> str:
        """Why the training batches keep ultralytics' CPU augmentation ("" when they do not)."""
        why = setting_keeps_cpu(self.gpu_augment, device, getattr(dataset, "cache", None))
        if why:
            return why
        from trainfuse.ultralytics.augment import deferred

        return deferred.unsupported(dataset, hyp, tasks=self.gpu_augment is True)

    def training_dataset(self, dataset, hyp, device: torch.device, batch: int | None, pad: bool):
        """Ultralytics' training ``dataset``, its augmentation deferred to the GPU where it can be,
        and its batches carrying the labels padded to their bucketed capacity when ``pad`` (a
        fused loss trains).

        Args:
            dataset: what ultralytics' ``build_dataset`` made for training.
            hyp: the trainer's ``args`` (the augmentation hyperparameters, ``workers``).
            device: the training device.
            batch: the batch size.
            pad: pad the labels on the CPU for a sync-free loss.
        """
        self.rows = []
        self.augment_reason = self._augment_off(dataset, hyp, device)
        if self.augment_reason:
            why = f"augmentation on the CPU: {self.augment_reason}"
            self.rows.append(Row("augment", "augmentation", OFF, why))
            if pad:
                dataset.collate_fn = PadTargets(dataset.collate_fn)
            return dataset
        from trainfuse.ultralytics.augment import deferred
        from trainfuse.ultralytics.augment.decode import JpegDecoder, ResidentIndex, why_not_gpu_decoding

        decode = device.type == "cuda"
        if decode and (why := why_not_gpu_decoding()):
            decode = False
            self.rows.append(Row("augment", "JPEG decoding", OFF, f"JPEGs decoded by the workers: {why}"))
        # the images the decoder keeps for good, which the workers then send without their bytes
        resident = ResidentIndex(len(dataset.im_files)) if decode else None
        deferred.install(dataset, hyp, pad=pad, decode=decode, resident=resident)
        if decode:  # the workers' recent images, for the mosaic, stay decoded
            self.jpeg_decoder = JpegDecoder(capacity=max(4 * (batch or 16),
                                                         (hyp.workers + 1) * dataset.max_buffer_length),
                                            index=resident)
        how = ("JPEG decoding, then the random warp, HSV and flips in one kernel per batch, on the GPU "
               "(the loader's workers read the files and move the labels; the same random parameters)"
               if decode else "random warp, HSV and flips in one kernel per batch (the loader's workers "
               "decode, paste what the warp reads and move the labels)")
        self.rows.append(Row("augment", "augmentation", ON, how))
        return dataset

    def training_loader(self, loader, device: torch.device):
        """Ultralytics' training loader; on CUDA (``prefetch``), its batches copied to the GPU one
        batch ahead on a side stream, and their deferred augmentation run there."""
        if not self.prefetch or device.type != "cuda":
            return loader
        finish = functools.partial(_finish_deferred, self.jpeg_decoder)
        # decoding waits for the GPU: in a thread, off the loop's host time
        return DevicePrefetcher(loader, device, finish=finish, background=self.jpeg_decoder is not None)

    def prepare(self, batch: dict, device: torch.device, pad: bool) -> dict:
        """A training batch before ultralytics' ``preprocess_batch``: a deferred one finished on
        the device where the prefetcher did not, the labels padded on the CPU (``pad``) where the
        loader did not (ultralytics' preprocessing then moves them with the rest of the batch)."""
        from trainfuse.ultralytics.augment.batch import finish_batch, is_deferred

        if is_deferred(batch):
            # the decoder's bytes and table are HostTensors: no ``to``, left on the host
            moved = {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}
            batch = finish_batch(moved, self.jpeg_decoder)
        if pad and PADDED_KEY not in batch and batch["batch_idx"].device.type == "cpu":
            add_padded_targets(batch)
        return batch


def _finish_deferred(decoder, batch: dict) -> dict:
    """The prefetcher's last step for a batch (on its side stream): finish a deferred one."""
    from trainfuse.ultralytics.augment.batch import finish_batch, is_deferred

    return finish_batch(batch, decoder) if is_deferred(batch) else batch


__all__ = ["CPU_DEFAULT_REASON", "RAM_CACHE_REASON", "BatchLoading", "setting_keeps_cpu"]
