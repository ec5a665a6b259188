"""trainfuse: fused kernels for the parts of a PyTorch training step around the big matmuls."""

from trainfuse import amp, losses, nn
from trainfuse._runtime.backend import backend, describe
from trainfuse.optim import FusedAdam, FusedAdamW, FusedEMA, FusedSGD

__version__ = "0.1.0"  # the one statement of the version: pyproject.toml reads it from here

__all__ = ["FusedAdam", "FusedAdamW", "FusedEMA", "FusedSGD", "__version__", "amp", "backend", "describe",
           "losses", "nn"]
