"""What the run keeps on the device between epochs (:class:`DeviceCache`, option ``device_cache``):
the training images the GPU decoded (the decoder's resident set) and the validation batches, within
one :class:`~trainfuse.ultralytics.device_cache.CacheBudget` (a tenth of the device's memory by
default, the driver's free memory never under a fifth of it). Both hold what the run would have
read again, pixel for pixel: the batches, their order and the metrics do not change. They are
dropped when training ends.
"""

from __future__ import annotations

from typing_extensions import override

from trainfuse.clients import ON, SKIPPED, Row
from trainfuse.ultralytics.changes.base import Change, Run
from trainfuse.ultralytics.device_cache import CacheBudget, gib
from trainfuse.ultralytics.validate.cached import CachedBatches


class DeviceCache(Change):
    """The decoded training images and the validation batches kept on the device (module docstring).

    Args:
        setting: the trainer's ``device_cache``: True, False, or None (on for CUDA devices).
    """

    kind = "device cache"

    def __init__(self, setting: bool | None = None) -> None:
        self.setting = setting
        self.budget: CacheBudget | None = None
        self.cached: CachedBatches | None = None
        self._loader = None

    @override
    def name(self, run: Run) -> str:
        return "decoded images and validation batches"

    @override
    def why_off(self, run: Run) -> str | None:
        if self.setting is False:
            return "device_cache=False: each epoch reads and decodes its images again"
        if self.setting is None and run.device.type != "cuda":
            return "device_cache defaults to on for CUDA devices only (True keeps them in host memory here)"
        return None

    @override
    def why_not(self, run: Run) -> str | None:
        if run.loading.jpeg_decoder is None and _validator(run) is None:
            return "nothing to keep: the workers decode the training images and this rank does not validate"
        return None

    @override
    def apply(self, run: Run) -> None:
        if self.budget is None:  # (kept with the decoded images around a checkpoint load)
            self.budget = CacheBudget.for_device(run.device)
        decoder = run.loading.jpeg_decoder
        if decoder is not None:
            decoder.budget = self.budget
        validator = _validator(run)
        if validator is not None:
            self._loader = validator.dataloader
            self.cached = CachedBatches(self._loader, run.device, self.budget)
            validator.dataloader = self.cached

    @override
    def rows(self, run: Run) -> list[Row]:
        budget = f"within {gib(self.budget.limit)} for both"
        if self.budget.reserve:
            budget += f", leaving {gib(self.budget.reserve)} of the device free"
        rows = []
        if run.loading.jpeg_decoder is not None:
            rows.append(Row(self.kind, "decoded training images", ON, f"the training images the GPU decoded "
                            f"stay ({budget}): once all stay, epochs decode nothing and the loader's workers "
                            "read no image file"))
        else:
            rows.append(Row(self.kind, "decoded training images", SKIPPED, "the loader's workers decode the "
                            "training images (no GPU decoding): nothing decoded on the device to keep"))
        if self.cached is not None:
            rows.append(Row(self.kind, "validation batches", ON, f"the validation batches stay on the device "
                            f"after the first pass ({budget}): later passes leave the loader alone"))
        else:
            rows.append(Row(self.kind, "validation batches", SKIPPED, "no validator on this rank"))
        return rows

    @override
    def restore(self, run: Run, *, failed: bool) -> None:
        decoder = run.loading.jpeg_decoder
        # around a checkpoint load (NaN recovery) the decoded images stay: the files are the same,
        # and batches the loader's workers made already name them without their bytes
        keep = run.reloading and not failed and decoder is not None and decoder.budget is self.budget
        if decoder is not None and decoder.budget is self.budget and not keep:
            decoder.release()
            decoder.budget = None
        validator = _validator(run)
        if self.cached is not None:
            if validator is not None and validator.dataloader is self.cached:
                validator.dataloader = self._loader
            self.cached.release()
        self.cached, self._loader = None, None
        if not keep:
            self.budget = None


def _validator(run: Run):
    """The trainer's validator where it has a loader (the rank that validates), else None."""
    validator = getattr(run.trainer, "validator", None)
    return validator if getattr(validator, "dataloader", None) is not None else None


__all__ = ["DeviceCache"]
