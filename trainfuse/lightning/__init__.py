"""Lightning integration: ``FusedTraining``, one callback that runs a fit on trainfuse's kernels
(fused optimizers with clipping and EMA in the step, cast fusion, FusedMLP, fused losses).

Works with ``lightning.pytorch`` and ``pytorch_lightning`` (whichever are installed)."""

from trainfuse.clients import Row, SkipError
from trainfuse.lightning.callback import FusedTraining

__all__ = ["FusedTraining", "Row", "SkipError"]
