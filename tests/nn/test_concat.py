"""trainfuse.nn.concat.ConcatBuffer and trainfuse.nn.bn_silu_into.batch_norm_silu_into: a
concatenation whose parts are written into it by the ops that make them, against the same
pipeline built the eager way (batch_norm_silu, the shortcut's add, chunk and torch.cat), which
tests/nn/test_bn_silu.py checks against float64.

The pipeline is a C2f block's in small: cv1's output in the buffer with its second half also
dense, a bottleneck reading that half (its shortcut too) and writing its output in both places,
a last part in the buffer only; the loss reads the concatenation and both dense tensors, so each
part's grad comes from the concatenation and from the next part. The loss's weights are multiples
of 1/8 below 4: every grad sum is exact in float16 and bfloat16, so the eager pipeline's sums (in
the dtype) and ours (in float32 inside the kernels) agree, and every result must be bit for bit
the eager one's, in every dtype. The one exception is the interpreter's bfloat16 store, which
truncates where torch's add rounds: a part with a shortcut may then be one ulp off. On a GPU
the compiler contracts a float32 multiply-add in one kernel and not in another, so float32's
outputs there are bound by ulps of the normalized value instead (the grads stay exact)."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import assert_within_ulps
from trainfuse.nn import bn_stats
from trainfuse.nn.bn_silu import batch_norm_silu, batch_norm_silu_torch
from trainfuse.nn.bn_silu_into import batch_norm_silu_into
from trainfuse.nn.bn_stats import BNLaunch
from trainfuse.nn.concat import ConcatBuffer

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def small_tiles(kernels, monkeypatch):
    """The kernels (the interpreter on CPU) with tiles small enough that a few dozen positions
    make several programs of several tiles, and channel blocks that the halves split inside."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(bn_stats, "CONTIGUOUS", BNLaunch(rows=8, channels=4, programs_per_sm=1))
        reduce = BNLaunch(rows=2, channels=16, programs_per_sm=1, unroll=3)
        monkeypatch.setattr(bn_stats, "CHANNELS_LAST", BNLaunch(rows=4, channels=8, programs_per_sm=1,
                                                                reduce=reduce))
        monkeypatch.setattr(bn_stats, "FINALIZE_ROWS", 2)


def eighths(shape, g):
    """Multiples of 1/8 in (-4, 4): sums of a few are exact in every dtype."""
    return (torch.randint(-31, 32, shape, generator=g) / 8).to(DEVICE)


class Parts:
    """The inputs of the small C2f: three convolution outputs (cv1's of 2c channels), each a
    BatchNorm's parameters and running statistics, and the loss's weights."""

    def __init__(self, N, c, H, W, dtype, channels_last, affine, seed=0):
        g = torch.Generator().manual_seed(seed)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.c = c
        self.xs, self.bns = [], []
        pdtype = torch.float64 if dtype == torch.float64 else torch.float32
        for C in (2 * c, c, c):
            x = (torch.randn(N, C, H, W, generator=g) * 2 + 0.5).to(DEVICE, dtype)
            self.xs.append(x.contiguous(memory_format=fmt))
            w = (torch.rand(C, generator=g) + 0.5).to(DEVICE, pdtype) if affine else None
            b = (torch.randn(C, generator=g) * 0.5).to(DEVICE, pdtype) if affine else None
            rm = torch.randn(C, generator=g).to(DEVICE, pdtype)
            rv = (torch.rand(C, generator=g) + 0.5).to(DEVICE, pdtype)
            self.bns.append((w, b, rm, rv))
        self.G = eighths((N, 4 * c, H, W), g)
        self.G1 = eighths((N, c, H, W), g)
        self.G2 = eighths((N, c, H, W), g)

    def leaves(self):
        xs = [x.clone().requires_grad_() for x in self.xs]
        bns = [(w.clone().requires_grad_() if w is not None else None,
                b.clone().requires_grad_() if b is not None else None,
                rm.clone() if rm is not None else None, rv.clone() if rv is not None else None)
               for w, b, rm, rv in self.bns]
        return xs, bns


def ours(parts: Parts, training: bool, momentum=0.03, eps=1e-3):
    xs, bns = parts.leaves()
    c = parts.c
    buffer = ConcatBuffer(4 * c)
    (w0, b0, rm0, rv0), (w1, b1, rm1, rv1), (w2, b2, rm2, rv2) = bns
    s0, d1 = batch_norm_silu_into(xs[0], rm0, rv0, w0, b0, training, momentum, eps, buffer, c)
    s1, d2 = batch_norm_silu_into(xs[1], rm1, rv1, w1, b1, training, momentum, eps, buffer, 0, residual=d1)
    s2, none = batch_norm_silu_into(xs[2], rm2, rv2, w2, b2, training, momentum, eps, buffer, c)
    assert none is None
    out = buffer.join(s0, s1, s2)
    assert out.data_ptr() == buffer.tensor.data_ptr()  # the buffer itself: nothing copied
    return xs, bns, out, d1, d2


def eager(parts: Parts, training: bool, momentum=0.03, eps=1e-3):
    xs, bns = parts.leaves()
    (w0, b0, rm0, rv0), (w1, b1, rm1, rv1), (w2, b2, rm2, rv2) = bns
    y0 = batch_norm_silu(xs[0], rm0, rv0, w0, b0, training, momentum, eps)
    a, d1 = y0.chunk(2, 1)
    d2 = d1 + batch_norm_silu(xs[1], rm1, rv1, w1, b1, training, momentum, eps)
    y2 = batch_norm_silu(xs[2], rm2, rv2, w2, b2, training, momentum, eps)
    return xs, bns, torch.cat([a, d1, d2, y2], 1), d1, d2


def run(fn, parts, training):
    xs, bns, out, d1, d2 = fn(parts, training)
    loss = (out.float() * parts.G).sum() + (d1.float() * parts.G1).sum() + (d2.float() * parts.G2).sum()
    loss.backward()
    return out, d1, d2, xs, bns


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("N", "c", "H", "W"), [(2, 3, 5, 7), (1, 8, 4, 4), (3, 5, 3, 1)], ids=str)
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "contiguous"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_parts_written_in_place_equal_the_eager_concatenation(dtype, N, c, H, W, channels_last, training):
    parts = Parts(N, c, H, W, dtype, channels_last, affine=True)
    before = [x.clone() for x in parts.xs]
    got = run(ours, parts, training)
    want = run(eager, parts, training)
    out, d1, d2, xs, bns = got
    assert out.dtype == dtype and out.shape == (N, 4 * c, H, W)
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert d1.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    truncating = DEVICE.type == "cpu" and dtype == torch.bfloat16
    for k, (a, b) in enumerate(zip((out, d1, d2), want[:3])):
        if truncating and k != 1:  # the parts with a shortcut (d2, and its slice of out)
            assert_within_ulps(a, b, 1, dtype)
        else:
            assert_outputs_equal(a, b, f"output {k}")
    for k, (a, b) in enumerate(zip(xs, want[3])):
        assert_outputs_equal(a.grad, b.grad, f"x{k}'s grad")
        assert a.grad.stride() == b.grad.stride() or a.grad.is_contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    for k, (a, b) in enumerate(zip(bns, want[4])):
        for name, p, q in zip(("weight", "bias"), a[:2], b[:2]):
            assert torch.equal(p.grad, q.grad), f"bn {k}'s {name} grad"
        for name, p, q in zip(("running_mean", "running_var"), a[2:], b[2:]):
            assert torch.equal(p, q), f"bn {k}'s {name}"
    assert all(torch.equal(x, y) for x, y in zip(parts.xs, before))  # inputs untouched


def assert_outputs_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit; float32 on a GPU within 4 ulps of the largest of the normalized values (the
    multiply-add of the normalization contracted into an FMA in one kernel and not the other:
    one rounding apart, which cancellation makes large against a small output)."""
    if a.device.type == "cuda" and a.dtype == torch.float32:
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps * (1 + float(b.abs().max())), msg=what)
    else:
        assert torch.equal(a, b), what


def test_without_affine_parameters_or_running_statistics():
    parts = Parts(2, 4, 3, 5, torch.float32, True, affine=False)
    for k in range(3):
        parts.bns[k] = (None, None, None, None)
    got, want = run(ours, parts, True), run(eager, parts, True)
    assert_outputs_equal(got[0], want[0], "output")
    for a, b in zip(got[3], want[3]):
        assert_outputs_equal(a.grad, b.grad, "x's grad")


def test_a_part_without_grad_and_a_dense_tensor_left_unused():
    """A frozen input (no dx) with a shortcut whose grad is still wanted, and a dense output the
    loss never reads (its grad None: the slice's alone)."""
    parts = Parts(2, 4, 3, 3, torch.float32, True, affine=True)
    results = []
    for frozen in (True, False):
        xs, bns = parts.leaves()
        xs[1].requires_grad_(not frozen)
        r = torch.randn(2, 4, 3, 3, device=DEVICE).contiguous(memory_format=torch.channels_last)
        r.requires_grad_()
        buffer = ConcatBuffer(8)
        w1, b1, rm1, rv1 = bns[1]
        s1, unused = batch_norm_silu_into(xs[1], rm1, rv1, w1, b1, True, 0.1, 1e-5, buffer, 0, residual=r)
        s2 = buffer.write(r * 2)
        (buffer.join(s1, s2).float() * parts.G[:, :8]).sum().backward()
        assert (xs[1].grad is None) == frozen
        results.append((r.grad, w1.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][0], parts.G[:, :4] + 2 * parts.G[:, 4:8], rtol=0, atol=0)


def test_float64_takes_torchs_ops_and_a_copy():
    parts = Parts(2, 3, 4, 4, torch.float64, True, affine=True)
    got, want = run(ours, parts, True), run(eager, parts, True)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    for a, b in zip(got[3], want[3]):
        assert_outputs_equal(a.grad, b.grad, "x's grad")
    x = parts.xs[1]
    buffer = ConcatBuffer(3)
    _, dense = batch_norm_silu_into(x, None, None, None, None, True, 0.1, 1e-5, buffer, 1)
    torch.testing.assert_close(dense, batch_norm_silu_torch(x, None, None, None, None, True)[:, 1:])


def test_write_copies_any_part_and_casts_it():
    buffer = ConcatBuffer(5)
    a = torch.randn(2, 2, 3, 3, device=DEVICE, requires_grad=True)
    b = torch.randn(2, 3, 3, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
    out = buffer.join(buffer.write(a), buffer.write(b))
    assert out.dtype == torch.float32 and torch.equal(out, torch.cat([a, b.float()], 1))
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(a.grad, g[:, :2]) and b.grad.dtype == torch.float64
    assert torch.equal(b.grad, g[:, 2:].double())


def test_bad_input_is_refused_with_the_argument_named():
    x = torch.randn(2, 4, 3, 3, device=DEVICE)
    with pytest.raises(ValueError, match="dense_from"):
        batch_norm_silu_into(x, None, None, None, None, True, 0.1, 1e-5, ConcatBuffer(4), 5)
    with pytest.raises(ValueError, match="residual"):
        batch_norm_silu_into(x, None, None, None, None, True, 0.1, 1e-5, ConcatBuffer(4), 0,
                             residual=torch.randn(2, 4, 3, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"x must be \(N, C, H, W\)"):
        batch_norm_silu_into(x[0], None, None, None, None, True, 0.1, 1e-5, ConcatBuffer(4), 0)
    with pytest.raises(ValueError, match="running_mean"):
        batch_norm_silu_into(x, torch.zeros(3, device=DEVICE), torch.ones(4, device=DEVICE), None, None, True,
                             0.1, 1e-5, ConcatBuffer(4), 0)
    with pytest.raises(ValueError, match="overflows"):
        batch_norm_silu_into(x, None, None, None, None, True, 0.1, 1e-5, ConcatBuffer(3), 0)
    buffer = ConcatBuffer(8)
    s = buffer.write(x)
    with pytest.raises(ValueError, match="does not match"):
        buffer.write(torch.randn(2, 4, 3, 2, device=DEVICE))
    with pytest.raises(ValueError, match="4 of 8 channels written"):
        buffer.join(s)
    t = buffer.write(x)
    with pytest.raises(ValueError, match="not the buffer's"):
        buffer.join(t, s)
    with pytest.raises(ValueError, match="channels must be positive"):
        ConcatBuffer(0)
