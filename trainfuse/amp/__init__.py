"""Mixed precision around the optimizer: cast fusion with float32 masters, fused clipping, and a
GradScaler whose inf check is the fused optimizer's statistics pass."""

from trainfuse.amp.casts import KEEP_FP32, NORM_LAYERS, fp32_state_dict, fuse_casts
from trainfuse.amp.clip import clip_grad_norm_
from trainfuse.amp.scaler import GradScaler

__all__ = ["KEEP_FP32", "NORM_LAYERS", "GradScaler", "clip_grad_norm_", "fp32_state_dict", "fuse_casts"]
