"""Float rounding helpers for kernels: float32 -> bfloat16 rounding to nearest even under the Triton
interpreter, and float32 division to 2 ulp.

The interpreter (triton <= 3.9) converts float32 to bfloat16 by truncation, where the GPU's
``cvt`` rounds to nearest even. Kernels that store bfloat16 round by hand under the interpreter,
so that the CPU tests check the bits a GPU writes; compiled kernels use the native conversion.
"""

import triton
import triton.language as tl


@triton.jit
def round_bf16_rne(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), returned as float32 with the
    low 16 bits zero, so that ``.to(tl.bfloat16)`` then truncates to the right value. Infinities
    stay infinite and values past bfloat16's largest finite round to inf, as on the GPU. A NaN
    stays NaN: it gets its quiet bit set instead of the rounding bias, which would carry a NaN's
    payload into the exponent or the sign, and whose truncation would leave an infinity where the
    payload is all in the low 16 bits (0x7F800001)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, bits | 0x400000, rounded).to(tl.float32, bitcast=True)


@triton.jit
def fast_div(a, b):
    """a / b to 2 ulp in float32: IEEE division costs ~10x the instructions, and the loss kernels do
    a dozen per CIoU box pair and two per BCE element (where bf16 makes them compute-bound); exact
    in float64."""
    if a.dtype == tl.float64:
        return a / b
    return tl.fdiv(a, b)


__all__ = ["fast_div", "round_bf16_rne"]
