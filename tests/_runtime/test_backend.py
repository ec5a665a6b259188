"""The backend switch: code that torch.compile traces takes the torch path, so a fused module
inside a compiled model computes what the eager one does instead of handing dynamo a Triton
launch."""

from __future__ import annotations

import torch

from trainfuse._runtime.backend import use_triton
from trainfuse.nn import FusedMLP


def test_traced_code_takes_the_torch_path(kernels, device):
    assert use_triton(device)  # the kernels fixture: Triton everywhere outside compiled code
    seen = []

    def probe(x):
        seen.append(use_triton(x.device))
        return x * 2

    torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(3, device=device))
    assert seen == [False]


def test_a_fused_mlp_inside_a_compiled_module_runs_and_matches_eager(kernels, device):
    torch.manual_seed(0)
    mlp = FusedMLP([8, 16, 4], activation="relu").to(device)
    x = torch.randn(5, 8, device=device)
    eager = mlp(x)
    compiled = torch.compile(mlp, backend="eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
