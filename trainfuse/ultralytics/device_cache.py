"""The device memory a run's caches may hold (:class:`CacheBudget`): the training images the GPU
has decoded (:class:`~trainfuse.ultralytics.augment.decode.JpegDecoder`'s resident set) and the
validation batches (:class:`~trainfuse.ultralytics.validate.cached.CachedBatches`).

With ultralytics' default ``cache=False`` every epoch reads and decodes every image again: the
training JPEGs on the GPU (nvJPEG, 5-7 ms of each batch's 10 ms on the decoding thread, on an
H200 machine), the validation images in the loader's workers, whose batches are then pinned
(about 30 MB a batch of 32 at 640 px) and copied to the GPU. The pixels do not change between
epochs (the random augmentation is applied after), so where they fit, the run keeps them on the
device after their first use. A budget bounds what they hold together: by default a tenth of the
device's memory, and never so much that the driver's free memory would fall under a fifth of it
(the checks run at each admission, after the first steps have reserved the step's own memory).
What does not fit is read as before.
"""

from __future__ import annotations

import os

import torch

FRACTION = 0.10  # of the device's memory, for all the run's caches together
RESERVE = 0.20  # of the device's memory, left free (as the driver counts it) after each admission


def memory_of(device: torch.device) -> int:
    """The memory of ``device`` in bytes: a CUDA device's, else the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class CacheBudget:
    """Bytes the run's caches may hold on ``device`` (see the module).

    Args:
        limit: bytes held at most, all caches together (>= 0).
        device: where the caches live; on CUDA, an admission also leaves ``reserve`` bytes free
            as ``torch.cuda.mem_get_info`` counts them.
        reserve: see ``device``.

    Attributes:
        used: bytes held now; ``refused``: admissions refused so far.
    """

    def __init__(self, limit: int, device: torch.device | str = "cpu", reserve: int = 0) -> None:
        if limit < 0:
            raise ValueError(f"CacheBudget: limit must be >= 0 bytes, got {limit}")
        if reserve < 0:
            raise ValueError(f"CacheBudget: reserve must be >= 0 bytes, got {reserve}")
        self.limit = int(limit)
        self.device = torch.device(device)
        self.reserve = int(reserve)
        self.used = 0
        self.refused = 0

    @classmethod
    def for_device(cls, device: torch.device | str, fraction: float = FRACTION,
                   reserve: float = RESERVE) -> CacheBudget:
        """``fraction`` of ``device``'s memory, leaving ``reserve`` of it free on CUDA."""
        device = torch.device(device)
        if not 0 <= fraction <= 1 or not 0 <= reserve <= 1:
            raise ValueError(f"CacheBudget.for_device: fraction and reserve must be within [0, 1], got "
                             f"{fraction} and {reserve}")
        total = memory_of(device)
        return cls(int(total * fraction), device, int(total * reserve) if device.type == "cuda" else 0)

    def take(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more if they fit (True), else nothing changes (False)."""
        if self.used + nbytes > self.limit or not self._room(nbytes):
            self.refused += 1
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Release ``nbytes`` taken before."""
        if nbytes > self.used:
            raise ValueError(f"CacheBudget: releasing {nbytes} bytes, only {self.used} are held")
        self.used -= nbytes

    def _room(self, nbytes: int) -> bool:
        if self.device.type != "cuda" or not self.reserve:
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        return free - nbytes >= self.reserve

    def __repr__(self) -> str:
        return f"CacheBudget(used={self.used}, limit={self.limit}, device={self.device})"


def gib(nbytes: int) -> str:
    """``nbytes`` for a log line."""
    return f"{nbytes / 2**30:.2f} GiB"


__all__ = ["FRACTION", "RESERVE", "CacheBudget", "gib", "memory_of"]
