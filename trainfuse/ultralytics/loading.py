"""The training batches of :class:`~trainfuse.ultralytics.FusedDetectionTrainer`: how they are built,
augmented, padded and brought to the GPU (a mixin of the trainer; the rest of it is the step).

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
from ultralytics.utils.torch_utils import unwrap_model

from trainfuse.clients import OFF, ON
from trainfuse.losses.detection.targets import PADDED_KEY, PadTargets, add_padded_targets
from trainfuse.ultralytics.choices import takes_fused_loss
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
    """The trainer's dataset, loader and ``preprocess_batch`` (see the module).

    Attributes:
        gpu_augment: True augments the training batches' pixels on the GPU where the dataset
            allows it (on a CPU device, through the torch path); False keeps ultralytics' CPU
            transforms; None (the default) is True on CUDA where the images are read from disk
            every epoch (``cache`` False or ``"disk"``) and False otherwise: with ``cache="ram"``
            the workers neither read nor decode, keep up with the step, and the GPU's share of
            the augmentation only adds to it (:data:`RAM_CACHE_REASON`). Also a keyword of the
            trainer's constructor.
        augment_reason: empty when the training batches are augmented on the GPU, else why not.
        jpeg_decoder: with GPU augmentation on CUDA, the
            :class:`~trainfuse.ultralytics.augment.decode.JpegDecoder` that decodes the training
            JPEGs and keeps the workers' recent ones (its ``decoded`` and ``reused`` counts); else None.
        prefetch: on CUDA, copy the training batches to the GPU one batch ahead on a side stream
            (a subclass may set False).
    """

    gpu_augment: bool | None = None
    augment_reason = "no training dataset yet"
    prefetch = True
    jpeg_decoder = None

    def _augment_off(self, dataset) -> str:
        """Why the training batches keep ultralytics' CPU augmentation ("" when they do not)."""
        why = setting_keeps_cpu(self.gpu_augment, self.device, getattr(dataset, "cache", None))
        if why:
            return why
        from trainfuse.ultralytics.augment import deferred

        return deferred.unsupported(dataset, self.args)

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None):
        """Ultralytics' dataset; in training, its augmentation deferred to the GPU where it can be
        (``gpu_augment``), and its batches carrying the labels padded to their bucketed capacity
        when the loss is fused."""
        dataset = super().build_dataset(img_path, mode, batch)
        if mode != "train":
            return dataset
        pad = bool(self.fused_loss and takes_fused_loss(unwrap_model(self.model)))
        self.augment_reason = self._augment_off(dataset)
        if self.augment_reason:
            self._note("augment", "augmentation", OFF, f"augmentation on the CPU: {self.augment_reason}")
            if pad:
                dataset.collate_fn = PadTargets(dataset.collate_fn)
            return dataset
        from trainfuse.ultralytics.augment import deferred
        from trainfuse.ultralytics.augment.decode import JpegDecoder, why_not_gpu_decoding

        decode = self.device.type == "cuda"
        if decode and (why := why_not_gpu_decoding()):
            decode = False
            self._note("augment", "JPEG decoding", OFF, f"JPEGs decoded by the workers: {why}")
        deferred.install(dataset, self.args, pad=pad, decode=decode)
        if decode:  # the workers' recent images, for the mosaic, stay decoded
            self.jpeg_decoder = JpegDecoder(capacity=max(4 * (batch or 16),
                                                     (self.args.workers + 1) * dataset.max_buffer_length))
        how = ("JPEG decoding, then the random warp, HSV and flips in one kernel per batch, on the GPU "
               "(the loader's workers read the files and move the labels; the same random parameters)"
               if decode else "random warp, HSV and flips in one kernel per batch (the loader's workers "
               "decode, paste what the warp reads and move the labels)")
        self._note("augment", "augmentation", ON, how)
        return dataset

    def get_dataloader(self, dataset_path: str, batch_size: int = 16, rank: int = 0, mode: str = "train"):
        """Ultralytics' loader; in training on CUDA (``prefetch``), its batches copied to the GPU one
        batch ahead on a side stream, and their deferred augmentation run there."""
        loader = super().get_dataloader(dataset_path, batch_size, rank, mode)
        if mode == "train" and self.prefetch and self.device.type == "cuda":
            finish = functools.partial(_finish_deferred, self.jpeg_decoder)
            # decoding waits for the GPU: in a thread, off the loop's host time
            loader = DevicePrefetcher(loader, self.device, finish=finish,
                                      background=self.jpeg_decoder is not None)
        return loader

    def preprocess_batch(self, batch: dict) -> dict:
        """Finish a deferred batch on the device where the prefetcher did not, pad the labels on the
        CPU where the loader did not, then ultralytics' preprocessing (which moves the padded
        labels to the device with the rest of the batch)."""
        from trainfuse.ultralytics.augment.batch import finish_batch, is_deferred

        if is_deferred(batch):
            # the decoder's bytes and table are HostTensors: no ``to``, left on the host
            moved = {k: v.to(self.device, non_blocking=True) if hasattr(v, "to") else v
                     for k, v in batch.items()}
            batch = finish_batch(moved, self.jpeg_decoder)
        if self._pad_targets and PADDED_KEY not in batch and batch["batch_idx"].device.type == "cpu":
            add_padded_targets(batch)
        return super().preprocess_batch(batch)


def _finish_deferred(decoder, batch: dict) -> dict:
    """The prefetcher's last step for a batch (on its side stream): finish a deferred one."""
    from trainfuse.ultralytics.augment.batch import finish_batch, is_deferred

    return finish_batch(batch, decoder) if is_deferred(batch) else batch


__all__ = ["CPU_DEFAULT_REASON", "RAM_CACHE_REASON", "BatchLoading", "setting_keeps_cpu"]
