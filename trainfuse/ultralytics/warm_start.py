"""The run's Triton kernels compiled while ultralytics sets the run up
(:mod:`trainfuse._runtime.precompile`), and what the run launched remembered for the next one.

On a machine whose Triton cache is empty, the first training step would otherwise compile every
kernel of the fused step one after another. The trainer starts the workers when it is built, before
ultralytics checks the dataset, builds the model and starts the loaders' workers; a launch of a
kernel a worker is still compiling waits for that worker.
"""

from __future__ import annotations

import torch
from ultralytics.utils import RANK

from trainfuse._runtime import precompile

MANIFEST = "ultralytics"
# the fused blocks' kernels for the models the trainers fuse by default (trainfuse.ultralytics.block_kernels)
BLOCKS_MANIFEST = "ultralytics-blocks"


class KernelsAhead:
    """Workers compiling the ``ultralytics`` manifest for a trainer on ``device`` (on CUDA, in the
    process of rank 0 or of a single-GPU run).

    Args:
        device: the trainer's device.
        blocks: the fused blocks' kernels too (:data:`BLOCKS_MANIFEST`).
    """

    def __init__(self, device: torch.device, blocks: bool = False) -> None:
        self._cuda = device.type == "cuda"
        self._since = len(precompile.first_launches())  # an earlier run's in this process are not ours
        also = (BLOCKS_MANIFEST,) if blocks else ()
        self._ahead = precompile.ahead(MANIFEST, also=also) if self._cuda and RANK in {-1, 0} else None

    def started(self) -> str | None:
        """A line for the log saying what is compiled ahead, or None where nothing is."""
        ahead = self._ahead
        if ahead is None:
            return None
        before = f"{ahead.compiled_before} compiled on an earlier run"
        if not ahead.workers:
            return f"the {ahead.entries} kernel specializations of this machine's runs: {before}"
        return (f"{ahead.entries} kernel specializations: {before}, {len(ahead.pending)} compiling in "
                f"{ahead.workers} processes (a launch waits for its own)")

    def finished(self) -> str | None:
        """End the workers; a line for the log saying which kernels the run launched first and
        how long that took, and how long the run waited for the workers (None off CUDA)."""
        ahead, self._ahead = self._ahead, None
        waited, failures, waits = 0.0, [], {}
        if ahead is not None and ahead.workers:
            ahead.stop()
            waited, failures, waits = ahead.waited, ahead.failures, ahead.waits
        return precompile.summary(waited, self._since, failures, waits) if self._cuda else None

    def remember(self) -> None:
        """Add the specializations this run launched to this machine's manifest."""
        if RANK in {-1, 0}:
            precompile.remember(MANIFEST)


__all__ = ["BLOCKS_MANIFEST", "MANIFEST", "KernelsAhead"]
