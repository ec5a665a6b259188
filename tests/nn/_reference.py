"""What FusedMLP is checked against: the same chain in plain torch (``nn.Sequential`` or
:func:`mlp_reference`), in float64 for the tight checks, and the error measure the tests use."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

# ||ours - float64|| / ||float64|| may be at most this, or twice nn.Sequential's own error in the
# same dtype (a float16 chain rounds every layer's output; so does torch)
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}

_ACTIVATIONS = {"none": lambda v: v, "relu": torch.relu, "gelu": F.gelu,
                "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``a`` must be finite)."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(model: nn.Module, x: torch.Tensor, g: torch.Tensor, autocast: torch.dtype | None = None):
    """Output, input grad and every param grad of ``model`` on ``x`` with upstream grad ``g``."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = model(x)
    y.backward(g.to(y.dtype))
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def reference(model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """The same chain as plain nn.Sequential in float64 (weights as stored, upcast)."""
    seq = nn.Sequential(*copy.deepcopy(list(model.children()))).double()
    return run(seq, x.double(), g.double())


def rounded(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A float32 copy of ``model`` whose params are rounded to ``dtype`` first: the operands
    autocast gives the matmuls, for a float64 reference of an autocast run."""
    r = copy.deepcopy(model).float()
    for p in r.parameters():
        p.data = p.data.to(dtype).float()
    return r


def assert_close_to_reference(ours, torch_same_dtype, ref, dtype, what="", factor=2.0):
    """Each of ``ours`` (:func:`run`'s list) within ``TOL[dtype]`` of ``ref`` (float64), or within
    ``factor`` times the error of ``torch_same_dtype`` (torch's chain in the same dtype)."""
    names = ["output", "input grad"] + [f"param grad {i}" for i in range(len(ref) - 2)]
    for name, a, t, r in zip(names, ours, torch_same_dtype, ref):
        assert a.shape == r.shape, f"{what} {name}: shape {tuple(a.shape)} vs {tuple(r.shape)}"
        limit = max(TOL[dtype], factor * rel(t, r))
        assert rel(a, r) <= limit, f"{what} {name}: error {rel(a, r):.2e} > {limit:.2e}"


def mlp_reference(x: torch.Tensor, weights, biases, activations, dropout_masks=None, ps=None) -> torch.Tensor:
    """The chain in plain torch (``F.linear``, the activation, dropout with the given keep masks),
    in any dtype (float64 for the tight checks)."""
    h = x
    for i, (w, b, act) in enumerate(zip(weights, biases, activations)):
        h = _ACTIVATIONS[act](F.linear(h, w, b))
        if dropout_masks is not None and dropout_masks[i] is not None:
            h = h * dropout_masks[i].to(h.dtype) / (1.0 - ps[i])
    return h
