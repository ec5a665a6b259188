"""Drop-in fused optimizers (torch.optim's arguments, defaults and state_dict layout)."""

from trainfuse.optim.adam import FusedAdam, FusedAdamW
from trainfuse.optim.sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD"]
