"""Drop-in fused optimizers (torch.optim's arguments, defaults and state_dict layout) and FusedEMA."""

from trainfuse.optim._base import MASTER_KEY, FusedOptimizer
from trainfuse.optim.adam import FusedAdam, FusedAdamW
from trainfuse.optim.ema import FusedEMA
from trainfuse.optim.portable import torch_state_dict
from trainfuse.optim.sgd import FusedSGD

__all__ = ["MASTER_KEY", "FusedAdam", "FusedAdamW", "FusedEMA", "FusedOptimizer", "FusedSGD",
           "torch_state_dict"]
