"""Drop-in fused optimizers (torch.optim's arguments, defaults and state_dict layout) and FusedEMA.

The fused optimizers are exported from :data:`trainfuse.optim.registry.COUNTERPARTS`:
``FusedAdamW``, ``FusedAdam``, ``FusedSGD``, ``FusedMuSGD``, ``FusedMuon``, and whatever a new
registry line adds.
"""

from trainfuse.optim import registry
from trainfuse.optim._base import MASTER_KEY, FusedOptimizer
from trainfuse.optim.ema import FusedEMA
from trainfuse.optim.portable import torch_state_dict

globals().update(registry.fused_classes())

__all__ = ["MASTER_KEY", "FusedEMA", "FusedOptimizer", "registry", "torch_state_dict",
           *registry.fused_classes()]
