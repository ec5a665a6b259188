"""What the loss kernels share: launch shapes and broadcast operands.

A reduced loss is one launch: every program writes its partial sum and the program that arrives
last adds them up in a fixed order (``trainfuse._runtime.reduce.reduce_partials``), so the loss is
bit-identical run to run (ultralytics trains with ``deterministic=True``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from trainfuse._runtime.launch import CachedLauncher, stream_workspace
from trainfuse._runtime.rounding import fast_div

launcher = CachedLauncher()


@dataclasses.dataclass
class LossLaunch:
    """A program handles ``block * unroll`` elements (``block`` at a time) with ``num_warps``
    warps. Tests shrink ``block`` so that small inputs span several programs."""

    block: int = 1024
    unroll: int = 4
    num_warps: int = 4
    per_sm: int = 8  # programs per SM of a persistent grid

    def programs(self, n: int) -> int:
        return max(1, -(-n // (self.block * self.unroll)))


# elementwise streams (BCE): from a sweep on the H100 (torch 2.11, triton 3.6) at (64, 8400, 80):
# 4096 x 2 elements per tile, 8 warps, 4 programs per SM was best in float32 (178 us, 97% of copy
# bandwidth): 32 loads in flight per thread hide the memory latency
config = LossLaunch(block=4096, unroll=2, num_warps=8, per_sm=4)
# 16-bit logits: half the bytes per element, so the math is the limit: that tile needs 164
# registers a thread, one program (8 warps) per SM; smaller tiles keep several resident
config16 = LossLaunch(block=1024, unroll=4, num_warps=4, per_sm=8)
# box pairs (IoU): a few hundred flops per pair, so small programs and many of them: 8,400 boxes
# (YOLO at 640 px) still spread over 33 SMs
box_config = LossLaunch(block=256, unroll=1)


def stream_config(t: torch.Tensor) -> LossLaunch:
    """The launch shape of an elementwise loss stream over ``t`` (by its element size)."""
    return config16 if t.element_size() == 2 else config


REDUCTIONS = ("none", "mean", "sum")


@triton.jit
def bcast_index(offs, div, mod, BCAST: tl.constexpr):
    """Index into an operand broadcast to the loss's shape (see :func:`broadcast_operand`)."""
    if BCAST:
        return (offs // div) % mod
    return offs


def workspace(device: torch.device, nparts: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, counter)`` for a reduction of ``nparts`` programs on ``device``'s current
    stream: the engine's per-stream scratch (:func:`trainfuse._runtime.launch.stream_workspace`),
    so a loss call allocates nothing for it."""
    return stream_workspace(device, None, dtype, nparts, 1)


def broadcast_operand(t: torch.Tensor, shape: tuple[int, ...], inner: int = 0
                      ) -> tuple[torch.Tensor, int, int, bool]:
    """``t`` broadcast to ``shape`` as ``(flat, div, mod, bcast)``: outer index ``i`` (over
    ``shape`` without its last ``inner`` dims, which ``t`` has in full, e.g. a box's 4 values)
    reads ``flat[(i // div) % mod]`` (``flat[i]`` when not ``bcast``), times the inner size.

    A full tensor, a per-channel weight (``pos_weight`` of shape ``(C,)``), a per-row weight
    (``(N, 1)``) and an expanded scalar (the upstream grad of ``loss.sum()``) need no copy; a
    non-contiguous operand is compacted once, other patterns are materialized.
    """
    if t.shape == shape and t.is_contiguous():  # the common case first: no view, no copy
        return t, 1, 1, False
    if t.numel() == 1:  # a scalar, or a single weight
        return t, 1, 1, True
    shape = tuple(shape)
    outer = len(shape) - inner
    n = max(math.prod(shape[:outer]), 1)
    e = t.expand(shape)
    if e.is_contiguous():
        return e.reshape(-1), 1, n, False
    real = [d for d in range(outer) if shape[d] > 1 and e.stride(d) != 0]
    if real and real != list(range(real[0], real[-1] + 1)):
        return e.contiguous().reshape(-1), 1, n, False
    a, b = (real[0], real[-1] + 1) if real else (outer, outer)
    dims = [*range(a, b), *range(outer, len(shape))]
    kept = e.as_strided([shape[d] for d in dims], [e.stride(d) for d in dims])
    return kept.contiguous().reshape(-1), math.prod(shape[b:outer]), math.prod(shape[a:b]), True


def check_float(name: str, fn: str, t: torch.Tensor, *, dtypes=(torch.float32, torch.bfloat16,
                                                               torch.float16, torch.float64)):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{fn}: {name} must be a floating-point tensor "
                        f"({', '.join(str(d).removeprefix('torch.') for d in dtypes)}), got {t.dtype}")


__all__ = ["REDUCTIONS", "LossLaunch", "bcast_index", "box_config", "broadcast_operand", "check_float",
           "config", "config16", "fast_div", "launcher", "stream_config", "workspace"]
