"""The validation batches kept on the device after their first pass (:class:`CachedBatches`).

ultralytics validates every epoch on the same images, letterboxed the same way and in the same
order (no shuffling, no random augmentation), so a pass's batches are the same every epoch. With
``cache=False`` (the default) each pass reads and decodes them again in the loader's workers, and
the training process unpickles them, pins them (about 30 MB a batch of 32 at 640 px, on the
loader's one pinning thread) and copies them to the GPU. :class:`CachedBatches` wraps the
validation loader: during a pass it moves each batch's images to the device (where the validator's
``preprocess`` would have moved them) and keeps them, while a
:class:`~trainfuse.ultralytics.device_cache.CacheBudget` has room; once a whole pass is kept, later
passes hand out the kept batches and leave the loader alone. The validator gets a new dict each
time (its ``preprocess`` replaces values in it), with the kept tensors: the images on the device,
everything else as the loader made it. A pass that does not fit gives its bytes back and later
passes read from the loader as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainfuse.ultralytics.device_cache import CacheBudget


class CachedBatches:
    """``loader``'s batches, kept on ``device`` after their first pass (see the module).

    Args:
        loader: the validation loader (batches are dicts with an ``img`` tensor).
        device: where the images are kept.
        budget: what the kept images may take.

    Attributes:
        batches: the kept pass, or None until one is kept whole.
        why_not: why no pass is kept ("" while one may be).
    """

    def __init__(self, loader: Any, device: torch.device, budget: CacheBudget) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.budget = budget
        self.batches: list[dict] | None = None
        self.nbytes = 0
        self.why_not = ""

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # dataset, num_workers, batch_size, reset, close, ...
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[dict]:
        if self.batches is not None:
            for batch in self.batches:
                yield dict(batch)
            return
        if self.why_not:
            yield from self.loader
            return
        kept: list[dict] | None = []
        try:
            for batch in self.loader:
                if kept is not None:
                    kept = self._keep(kept, batch)
                    batch = dict(kept[-1]) if kept is not None else batch
                yield batch
        finally:
            if kept is not None and len(kept) == len(self.loader):
                self.batches = kept
            elif kept is not None:  # stopped early (an error, or a break): the next pass tries again
                self.release()

    def _keep(self, kept: list[dict], batch: Any) -> list[dict] | None:
        """``kept`` with ``batch`` added (its images on the device), or None (all given back)
        where the budget has no room."""
        img = batch.get("img") if isinstance(batch, dict) else None
        if not isinstance(img, torch.Tensor):
            self.release(f"its batches carry no 'img' tensor (got {type(batch).__name__})")
            return None
        if not self.budget.take(img.nbytes):
            left = self.budget.limit - self.budget.used
            self.release(f"a pass takes more than the cache budget has left ({left} of {self.budget.limit} "
                         f"bytes, at batch {len(kept)}), or the device's free memory would fall under its "
                         "reserve")
            return None
        self.nbytes += img.nbytes
        kept.append({**batch, "img": img.to(self.device, non_blocking=True)})
        return kept

    def release(self, why: str = "") -> None:
        """Drop the kept batches and give their bytes back; ``why``: keep none from now on."""
        self.budget.give(self.nbytes)
        self.nbytes = 0
        self.batches = None
        self.why_not = why


__all__ = ["CachedBatches"]
