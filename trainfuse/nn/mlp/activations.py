"""The activations FusedMLP fuses into its matmul epilogues, their grads, dropout's keep mask, and
:class:`Layer`, the epilogue settings of one layer.

Every function here is float32 math on a tile, called from the kernels in ``kernels.py``. For
GELU/SiLU the forward computes ``f'(pre)`` beside ``f(pre)`` (they share the erf / tanh /
sigmoid) and saves it for the backward, which then multiplies instead of evaluating erf and exp
again: that made the input grad's epilogue 80 us against ReLU's 44.5 us (B=8192, D=1024, H200).
ReLU's backward reads its output (``out > 0``), so it saves nothing more.
"""

import dataclasses

import triton
import triton.language as tl

ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}
DERIV_SAVED = (2, 3, 4)  # the activations whose derivative the forward saves for the backward
_RELU = tl.constexpr(1)
_GELU = tl.constexpr(2)
_GELU_TANH = tl.constexpr(3)


@dataclasses.dataclass(frozen=True)  # FusedMLP reuses one list of them across calls
class Layer:
    """What one layer of a chain does after its matmul: the kernels' epilogue settings."""

    act: int  # ACTIVATIONS value
    p: float  # dropout probability (0: no dropout)
    # GELU/SiLU: the forward saves nothing for the activation; the backward runs the layer's
    # forward matmul again for f'(pre) (a rows x width buffer less held from forward to backward
    # per layer, for one more matmul)
    recompute: bool = False


_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_TANH_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi), GELU's tanh approximation
_TANH_K = tl.constexpr(0.044715)


@triton.jit
def _tanh(u):
    # from exp: no libdevice, so the same code runs in the interpreter; 1 - 2 / (e^2u + 1) is exact
    # at +-inf and within 1e-7 absolute near 0 (GELU multiplies it by x / 2)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def activation_and_deriv(x, ACT: tl.constexpr):
    """(f(x), f'(x)) in float32 for GELU / GELU(approximate="tanh") / SiLU, sharing their erf,
    tanh or sigmoid: the forward's output and, when it saves it, the backward's derivative."""
    if ACT == _GELU:
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
        return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    elif ACT == _GELU_TANH:
        x2 = x * x
        t = _tanh((x + x2 * x * _TANH_K) * _TANH_C)
        return (0.5 * x * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (1.0 + x2 * (3.0 * _TANH_K)) * _TANH_C)
    else:  # SiLU (ACTIVATIONS["silu"])
        s = _sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s))


@triton.jit
def activation(x, ACT: tl.constexpr):
    """f(x) in float32, as torch's ReLU / GELU / GELU(approximate="tanh") / SiLU compute it."""
    if ACT == _RELU:
        return tl.where(x < 0.0, 0.0, x)  # NaN stays NaN, as in torch.relu
    elif ACT == 0:
        return x
    else:
        f, _ = activation_and_deriv(x, ACT)  # one formula for f: the compiler drops the unused derivative
        return f


@triton.jit
def _activation_grad(g, saved, ACT: tl.constexpr):
    """g * f'(.) where ``saved`` is the output for ReLU and f'(pre-activation) otherwise."""
    if ACT == _RELU:
        return tl.where(saved > 0.0, g, 0.0)  # torch's threshold_backward on the output
    elif ACT == 0:
        return g
    else:
        return g * saved


@triton.jit
def undo_activation(g, saved, scale, ACT: tl.constexpr, DROP: tl.constexpr):
    """g * f'(pre) * keep / (1 - p) from what the forward saved, without drawing the dropout mask
    again: ReLU's saved output is > 0 only where kept (so only the scale is left to apply), and
    GELU/SiLU's saved derivative was stored times the mask and the scale. (With no activation the
    caller draws the mask again from the seed.)"""
    g = _activation_grad(g, saved, ACT)
    if DROP and ACT == _RELU:
        g = g * scale
    return g


@triton.jit
def keep_mask(seed, idx, p):
    """Dropout's keep mask for element index ``idx`` (row * cols + col): Philox, so forward and
    backward draw the same mask from the seed alone."""
    return tl.rand(seed, idx) >= p


__all__ = ["ACTIVATIONS", "DERIV_SAVED", "Layer", "activation", "activation_and_deriv", "keep_mask",
           "undo_activation"]
