"""The multi-tensor engine: one launch updates every tensor of every param group.

``table.py`` builds and caches the device tables; ``kernels.py`` holds the Triton helpers the
client kernels (optimizers, EMA, clipping) are written with.
"""

from trainfuse._engine.table import DTYPE_CODES, MultiTensorEngine, config

__all__ = ["DTYPE_CODES", "MultiTensorEngine", "config"]
