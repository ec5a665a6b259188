"""The cached launcher launches exactly what Triton's own launch would, call after call."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests._helpers import cuda
from trainfuse._runtime.launch import CachedLauncher, cdiv, next_power_of_2


@triton.jit
def _write_program_ids(out, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(out + pid * BLOCK + offs, pid + offs * 0)


@cuda  # off CUDA the launcher always takes Triton's own launch
@pytest.mark.parametrize("grid", [(6,), (3, 2)], ids=["1-d", "2-d"])
def test_every_program_of_the_grid_runs_on_every_call(grid):
    device = torch.device("cuda")
    launcher = CachedLauncher()
    n = grid[0] * (grid[1] if len(grid) > 1 else 1)
    for _ in range(3):  # the first call compiles; later ones take the cached path where it applies
        out = torch.full((n * 16,), -1, dtype=torch.int32, device=device)
        launcher(_write_program_ids, grid, out, BLOCK=16, num_warps=1)
        expected = torch.arange(n, dtype=torch.int32, device=device).repeat_interleave(16)
        assert torch.equal(out, expected)


def test_host_cdiv_and_next_power_of_2_are_tritons():
    """The plain-integer grid helpers give Triton's values (0, 1, powers of two and their
    neighbours, large counts, numpy integers)."""
    import numpy as np

    values = sorted({0, 1, 2, 3, *(2**k + d for k in range(1, 40) for d in (-1, 0, 1)), 10**12 + 7})
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        assert next_power_of_2(np.int64(n)) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 16, 64, 100, 4096):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)

