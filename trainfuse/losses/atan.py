"""atan for Triton kernels, from basic operations (libdevice's does not run in the interpreter):
float32 to float32 rounding, float64 within 2 ulp. The CIoU kernels (losses, the detection loss)
use it."""

import triton
import triton.language as tl

from trainfuse.losses._common import fast_div


@triton.jit
def _atan_f64(x):
    """atan in float64, by the same reduction as :func:`atan`'s float32 branch; pi/2 and pi/4 are
    added as a float64 head plus the tail the head misses. P (degree 10 in z = r^2) interpolates
    (atan(r)/r - 1)/z at 11 Chebyshev nodes of [0, tan(pi/8)^2]: 8e-18 relative error in exact
    arithmetic, so float64 rounding (about 1 ulp) dominates. Python float literals here are
    float64 constants (a scalar takes the tensor's dtype)."""
    a = tl.abs(x)
    zero = tl.zeros_like(a)
    big = a > 2.414213562373095
    mid = a > 0.41421356237309503
    num = tl.where(big, -1.0, tl.where(mid, a - 1.0, a))
    den = tl.where(big, a, tl.where(mid, a + 1.0, 1.0))
    r = num / den
    head = tl.where(big, zero + 1.5707963267948966, tl.where(mid, zero + 0.7853981633974483, zero))
    tail = tl.where(big, zero + 6.123233995736766e-17, tl.where(mid, zero + 3.061616997868383e-17, zero))
    z = r * r
    p = -0.019175404711104935 * z + 0.03923044778479309
    p = p * z - 0.050854078345894844
    p = p * z + 0.05858140904866328
    p = p * z - 0.06664510525508936
    p = p * z + 0.07692183125376892
    p = p * z - 0.0909090457530649
    p = p * z + 0.11111111015187018
    p = p * z - 0.14285714284665682
    p = p * z + 0.19999999999995516
    p = p * z - 0.3333333333333333
    y = head + (r + (r * z * p + tail))
    return tl.where(x < 0, -y, y)


@triton.jit
def atan(x):
    """atan from basic operations: odd symmetry, then atan(x) = pi/2 - atan(1/x) above
    tan(3pi/8) and pi/4 + atan((x - 1)/(x + 1)) above tan(pi/8), then the polynomial. NaN stays
    NaN, +-inf gives +-pi/2. Triton's libdevice atan does not run under TRITON_INTERPRET=1; this
    runs everywhere. Float32: P is a least-squares fit (degree 4 in z = r^2, relative error) of
    atan on [0, tan(pi/8)]: max relative error 2e-9 there, so float32 rounding dominates. Float64
    (:func:`_atan_f64`): within 2 ulp of the correctly rounded atan."""
    if x.dtype == tl.float64:
        return _atan_f64(x)
    a = tl.abs(x)
    big = a > 2.414213562373095
    mid = a > 0.41421356237309503
    num = tl.where(big, -1.0, tl.where(mid, a - 1.0, a))
    den = tl.where(big, a, tl.where(mid, a + 1.0, 1.0))
    r = fast_div(num, den)
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = r * r
    p = (((-0.061694869 * z + 0.1062866029) * z - 0.1424805588) * z + 0.199986983) * z - 0.3333331861
    y = base + (r + r * z * p)
    return tl.where(x < 0, -y, y)


__all__ = ["atan"]
