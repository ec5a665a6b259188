"""What the detection-loss kernels share: the launcher, the block sizes, the reduction scratch,
and the several-slot version of the runtime's one-launch sum.

A reduced value is one launch: every program stores its partial sums (:func:`arrive`, one slot
per quantity), counts itself in (``trainfuse._runtime.reduce.last_to_arrive``), and the program
that arrives last adds each slot up in a fixed order (:func:`gather_sum`, float64) and re-arms
the counter, so the loss is bit-identical run to run without float atomics (ultralytics trains
with ``deterministic=True``). The denominators (``target_scores_sum``) live on the device:
dividing by them in the kernel is what keeps the loss free of host syncs.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from trainfuse._runtime.launch import CachedLauncher, sm_count, stream_workspace

# the loss kernels' launches: cached launch sites (CachedLauncher relaunches grids of any rank)
launcher = CachedLauncher()


@dataclasses.dataclass
class Blocks:
    """Elements per program of each kernel (tests shrink them so tiny inputs span several)."""

    box: int = 128  # anchors of box_loss: a (128, 16) logit tile per side; 8,400 anchors in 66 programs
    assign: int = 128  # anchors of the assigner's metric and resolve kernels
    scores: int = 1024  # anchors of the assigner's target-scores kernel
    cls: int = 1024  # anchors per tile of the class loss: 8,400 anchors in 9 tiles of a logit row


blocks = Blocks()


@triton.jit
def gather_sum(partials, nparts, slot):
    """Sum of ``partials[slot * nparts : (slot + 1) * nparts]`` in float64, in a fixed order."""
    RB: tl.constexpr = 1024
    acc = tl.zeros([RB], tl.float64)
    for i in range(0, nparts, RB):
        o = i + tl.arange(0, RB)
        acc += tl.load(partials + slot * nparts + o, mask=o < nparts, other=0.0,
                       cache_modifier=".cg").to(tl.float64)
    return tl.sum(acc, 0)


@triton.jit
def arrive(partials, nparts, slot, value):
    """Store this program's partial ``value`` in ``slot`` (one slot of ``nparts`` floats per
    summed quantity)."""
    tl.store(partials + slot * nparts + tl.program_id(0), value)


def scratch(device: torch.device, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, counter)`` of the current stream (kept across calls: no allocation)."""
    return stream_workspace(device, None, torch.float32, floats, 1)


def persistent_grid(device: torch.device, tiles: int, per_sm: int = 4) -> int:
    """Programs of a persistent grid over ``tiles`` tiles: a few per SM on a GPU, four under the
    interpreter (so the tile loop runs more than once in tests)."""
    most = sm_count(device.index) * per_sm if device.type == "cuda" else 4
    return max(1, min(tiles, most))


__all__ = ["Blocks", "arrive", "blocks", "gather_sum", "launcher", "persistent_grid",
           "scratch"]
