"""trainfuse: fused kernels for the parts of a PyTorch training step around the big matmuls."""

from trainfuse import amp, losses, nn, optim
from trainfuse._runtime.backend import backend, describe
from trainfuse.optim import FusedEMA

__version__ = "0.1.0"  # the one statement of the version: pyproject.toml reads it from here

# the fused optimizers of trainfuse.optim.registry: FusedAdamW, FusedAdam, FusedSGD, ...
globals().update(optim.registry.fused_classes())

__all__ = ["FusedEMA", "__version__", "amp", "backend", "describe", "losses", "nn", "optim",
           *optim.registry.fused_classes()]
