"""trainfuse.nn.bn_silu.batch_norm_silu (BatchNorm then SiLU, one op) against a float64 torch
reference: training and eval, affine or not, with and without running statistics, contiguous and
channels_last, 2-d to 4-d inputs, odd channel and spatial sizes, batch 1, every dtype we claim;
outputs bound by the output dtype's ulps, sums by float32's worst case; the running statistics;
the same bits on every call; inputs untouched; bad input refused. Kernels run through the
interpreter on CPU, with tiles shrunk so that small inputs span several programs and chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests._helpers import cuda, cuda_kernel_names, no_host_sync
from trainfuse.nn import bn_silu, bn_stats, param_grads
from trainfuse.nn.bn_silu import batch_norm_silu, batch_norm_silu_torch
from trainfuse.nn.bn_stats import BNLaunch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS32 = torch.finfo(torch.float32).eps
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, C, *spatial): odd sizes; channels past a tile of 4 (and of 64 channels_last, 70); batch 1;
# 2-d and 3-d inputs
SHAPES = [(2, 3, 5, 7), (1, 5, 4, 9), (3, 70, 2, 3), (4, 6), (2, 5, 11)]


@pytest.fixture(autouse=True)
def small_tiles(kernels, monkeypatch):
    """The kernels (the interpreter on CPU), tiles of 8 positions by 4 channels and 4 reduction
    programs, whose last to arrive reads their partials 2 at a time: a few dozen positions already
    make several programs of several tiles. channels_last's reductions tile otherwise than its
    elementwise kernels (other channel blocks, other rows, three tiles a loop turn)."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(bn_stats, "CONTIGUOUS", BNLaunch(rows=8, channels=4, programs_per_sm=1))
        reduce = BNLaunch(rows=2, channels=16, programs_per_sm=1, unroll=3)
        monkeypatch.setattr(bn_stats, "CHANNELS_LAST",
                            BNLaunch(rows=4, channels=8, programs_per_sm=1, reduce=reduce))
        monkeypatch.setattr(bn_stats, "FINALIZE_ROWS", 2)


MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def spacing(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between ``dtype``'s numbers at ``t``'s magnitude (float64): one ulp."""
    info = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(info.tiny))) - MANTISSA[dtype])


def make(shape, dtype, channels_last, affine=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g) * 3 + 1.5).to(DEVICE, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.rand(C, generator=g) + 0.5).to(DEVICE) if affine else None
    b = (torch.randn(C, generator=g) * 0.5).to(DEVICE) if affine else None
    rm = torch.randn(C, generator=g).to(DEVICE)
    rv = (torch.rand(C, generator=g) + 0.5).to(DEVICE)
    dy = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return x, w, b, rm, rv, dy


def reference(x, w, b, rm, rv, dy, training, momentum, eps):
    """float64: y, the grads, the running statistics after, and the scales the float32 rounding of
    dx, dw and db is bound by."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_() if w is not None else None
    b64 = b.double().requires_grad_() if b is not None else None
    rm64, rv64 = rm.double(), rv.double()
    y = batch_norm_silu_torch(x64, rm64, rv64, w64, b64, training, momentum, eps)
    y.backward(dy.double())
    dims = [0] + list(range(2, x.dim()))
    view = [1, -1] + [1] * (x.dim() - 2)
    if training:
        mean, var = x64.detach().mean(dims), x64.detach().var(dims, unbiased=False)
    else:
        mean, var = rm.double(), rv.double()
    xhat = (x64.detach() - mean.view(view)) / torch.sqrt(var.view(view) + eps)
    s = (w64.detach() if w is not None else 1.0) / torch.sqrt(var + eps)
    u = xhat * w64.detach().view(view) + b64.detach().view(view) if w is not None else xhat
    sig = torch.sigmoid(u)
    du = dy.double() * sig * (1 + u * (1 - sig))
    M = x.numel() // x.shape[1]
    dx_terms = (s.view(view).abs() * (du.abs() + du.abs().sum(dims, keepdim=True) / M * (1 + xhat.abs())
                                      * (1 + xhat.abs().amax())))
    sums = {"dw": (du * xhat).abs().sum(dims), "db": du.abs().sum(dims)}
    return y.detach(), x64.grad, w64.grad if w is not None else None, b64.grad if b is not None else None, \
        rm64, rv64, dx_terms, sums, M


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_float64_batch_norm_then_silu(shape, dtype, training):
    channels_last = len(shape) == 4 and shape[1] % 2 == 1  # both layouts across the shapes
    x, w, b, rm, rv, dy = make(shape, dtype, channels_last)
    momentum, eps = 0.03, 1e-3
    want = reference(x, w, b, rm.clone(), rv.clone(), dy, training, momentum, eps)
    y_ref, dx_ref, dw_ref, db_ref, rm_ref, rv_ref, dx_terms, sums, M = want
    xg = x.clone().requires_grad_()
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = batch_norm_silu(xg, rm, rv, wg, bg, training, momentum, eps)
    assert y.dtype == dtype and y.shape == x.shape
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last or not channels_last
    # one rounding to the output dtype, plus float32's: at most an ulp of the output
    err = (y.double() - y_ref).abs()
    bad = ~(err <= spacing(y_ref, dtype) + 1e-5 * (1 + y_ref.abs()))
    assert not bad.any(), (y[bad], y_ref[bad])
    y.backward(dy)
    assert xg.grad.dtype == dtype and wg.grad.dtype == torch.float32
    bound = 64 * EPS32 * dx_terms + (spacing(dx_ref, dtype) if dtype != torch.float32 else 0)
    err = (xg.grad.double() - dx_ref).abs()
    assert (err <= bound + 1e-30).all(), (err / (bound + 1e-30)).max()
    for got, ref, scale in ((wg.grad, dw_ref, sums["dw"]), (bg.grad, db_ref, sums["db"])):
        assert ((got.double() - ref).abs() <= M * EPS32 * scale + 1e-30).all()
    if training:
        torch.testing.assert_close(rm.double(), rm_ref, rtol=4 * EPS32, atol=4 * EPS32)
        torch.testing.assert_close(rv.double(), rv_ref, rtol=8 * EPS32, atol=8 * EPS32)


@pytest.mark.parametrize("affine", [True, False])
def test_without_running_statistics_or_affine_parameters(affine):
    x, w, b, _, _, dy = make((3, 5, 4, 4), torch.float32, False, affine=affine)
    xg = x.clone().requires_grad_()
    y = batch_norm_silu(xg, None, None, w, b, training=True)
    x64 = x.double().requires_grad_()
    w64, b64 = (w.double(), b.double()) if affine else (None, None)
    y64 = batch_norm_silu_torch(x64, None, None, w64, b64, True)
    torch.testing.assert_close(y.double(), y64.detach(), rtol=1e-5, atol=1e-5)
    y.backward(dy)
    y64.backward(dy.double())
    torch.testing.assert_close(xg.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)


def test_the_same_bits_every_call_and_inputs_left_as_they_were():
    x, w, b, rm, rv, dy = make((2, 9, 6, 5), torch.float16, True)
    before = [t.clone() for t in (x, w, b, dy)]
    outs = []
    for _ in range(2):
        xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        y = batch_norm_silu(xg, rm.clone(), rv.clone(), wg, bg, True, 0.1, 1e-5)
        y.backward(dy)
        outs.append((y, xg.grad, wg.grad, bg.grad))
    for a, c in zip(*outs):
        assert torch.equal(a, c)
    for t, t0 in zip((x, w, b, dy), before):
        assert torch.equal(t, t0)


def test_momentum_moves_the_running_statistics_as_batch_norm_does():
    x, w, b, rm, rv, _ = make((4, 7, 3, 3), torch.float32, False)
    rm2, rv2 = rm.clone(), rv.clone()
    for momentum in (0.1, 1.0, 0.0):
        batch_norm_silu(x, rm, rv, w, b, True, momentum, 1e-5)
        F.batch_norm(x, rm2, rv2, w, b, True, momentum, 1e-5)
        torch.testing.assert_close(rm, rm2, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(rv, rv2, rtol=2e-6, atol=2e-6)


def test_empty_batch_and_float64_take_torchs_path():
    x, w, b, rm, rv, _ = make((2, 3, 4, 4), torch.float32, False)
    empty = torch.empty(0, 3, 4, 4, device=DEVICE)
    assert batch_norm_silu(empty, rm, rv, w, b, False).shape == (0, 3, 4, 4)
    x64 = x.double()
    got = batch_norm_silu(x64, rm.double(), rv.double(), w.double(), b.double(), True)
    want = batch_norm_silu_torch(x64, rm.double().clone(), rv.double().clone(), w.double(), b.double(), True)
    assert got.dtype == torch.float64 and torch.allclose(got, want)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, b, rm, rv: batch_norm_silu(x[0, :, 0, 0], rm, rv, w, b), r"x must be \(N, C, \.\.\.\)"),
    (lambda x, w, b, rm, rv: batch_norm_silu(x, rm[:2], rv, w, b), r"running_mean must be a \(3,\) tensor"),
    (lambda x, w, b, rm, rv: batch_norm_silu(x, rm, None, w, b, True), "running_mean and running_var must"),
    (lambda x, w, b, rm, rv: batch_norm_silu(x, rm, rv, w, None), "weight and bias must be given together"),
    (lambda x, w, b, rm, rv: batch_norm_silu(x, None, None, w, b, False), "training=False normalizes"),
    (lambda x, w, b, rm, rv: batch_norm_silu(x[:1, :, :1, :1], rm, rv, w, b, True),
     "expected more than 1 value per channel when training"),
    (lambda x, w, b, rm, rv: batch_norm_silu(x, rm, rv, w, b, True, num_batches_tracked=torch.zeros(())),
     "num_batches_tracked must be a one-element int64 tensor"),
    (lambda x, w, b, rm, rv: bn_silu.split_batch_norm_silu(x[:, :2], rm[:2], rv[:2], w[:2], b[:2], True,
                                                           num_batches_tracked=3),
     "num_batches_tracked must be a one-element int64 tensor.*got int"),
])
def test_bad_input_is_refused_and_leaves_the_running_statistics(call, match):
    x, w, b, rm, rv, _ = make((2, 3, 4, 4), torch.float32, False)
    rm0, rv0 = rm.clone(), rv.clone()
    with pytest.raises(ValueError, match=f"batch_norm_silu: {match}"):
        call(x, w, b, rm, rv)
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0)


@cuda
def test_a_replayed_graph_gives_the_eager_bits_without_host_syncs_in_four_kernels():
    x, w, b, rm, rv, dy = make((8, 48, 40, 40), torch.float16, True)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()

    def step(rm_, rv_):
        y = batch_norm_silu(x, rm_, rv_, w, b, True, 0.03, 1e-3)
        gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
        # y detached: a graph kept alive keeps its leaves' AccumulateGrad nodes on the stream they
        # were made on, and torch 2.11 then refuses the capture's backward on another stream
        return y.detach(), gx, gw, gb

    rm_e, rv_e = rm.clone(), rv.clone()
    eager = step(rm_e, rv_e)
    rm_g, rv_g = rm.clone(), rv.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(rm.clone(), rv.clone())  # kernels compiled outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync(), torch.cuda.graph(graph):
        replayed = step(rm_g, rv_g)
    graph.replay()
    torch.cuda.synchronize()
    for a, c in zip(eager, replayed):
        assert torch.equal(a, c)
    assert torch.equal(rm_e, rm_g) and torch.equal(rv_e, rv_g)
    names = cuda_kernel_names(lambda: step(rm.clone(), rv.clone()))
    fused = [n for n in names if "bn_" in n]
    assert len(fused) == 4, names  # stats (totalled by the last to arrive), apply; grad sums (too), dx


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_the_affine_grads_go_into_grad_where_autograd_would_put_them(monkeypatch, channels_last):
    """Where nothing could tell (trainfuse.nn.param_grads), the grad sums' last program writes the
    weight's and bias's grads (first backward) and adds onto them (second), with no AccumulateGrad
    work: the bits autograd gives when a hook keeps them on its path; ``autograd.grad`` and a
    float64 weight keep autograd's path too."""
    modes = []
    affine = param_grads.affine

    def spy(*args):
        got = affine(*args)
        modes.append(got[0])
        return got

    monkeypatch.setattr(param_grads, "affine", spy)
    x, w, b, rm, rv, dy = make((2, 24, 5, 7), torch.float16, channels_last)

    def twice(hook: bool):
        w2, b2 = w.clone().requires_grad_(), b.clone().requires_grad_()
        if hook:
            w2.register_hook(lambda g: g)
        for _ in range(2):
            batch_norm_silu(x, rm.clone(), rv.clone(), w2, b2, True, 0.03, 1e-3).backward(dy)
        return w2.grad, b2.grad

    direct = twice(hook=False)
    assert modes == [param_grads.ASSIGN, param_grads.ADD]
    modes.clear()
    through_autograd = twice(hook=True)
    assert modes == [param_grads.NONE] * 2
    assert all(torch.equal(a, c) for a, c in zip(direct, through_autograd))
    modes.clear()
    w3, b3 = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = batch_norm_silu(x, rm.clone(), rv.clone(), w3, b3, True, 0.03, 1e-3)
    gw, gb = torch.autograd.grad(y, (w3, b3), dy)
    assert modes == [param_grads.NONE] and w3.grad is None and b3.grad is None
    w4, b4 = w.clone().requires_grad_(), b.clone().requires_grad_()
    batch_norm_silu(x, rm.clone(), rv.clone(), w4, b4, True, 0.03, 1e-3).backward(dy)
    assert torch.equal(w4.grad, gw) and torch.equal(b4.grad, gb) and modes[-1] == param_grads.ASSIGN


SPLIT_SHAPES = [(2, 6, 5, 7), (1, 4, 3, 3), (3, 70, 2, 3)]  # even channels; past a tile; batch 1
# every dtype on the small shapes; the one past a tile (many programs through the interpreter,
# several seconds a case) in float16, the dtype training runs it in
SPLIT_CASES = [(shape, dtype) for shape in SPLIT_SHAPES for dtype in DTYPES
               if shape[1] < 70 or dtype is torch.float16]


@pytest.mark.parametrize("shape,dtype", SPLIT_CASES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_split_halves_are_the_ops_bits_each_dense(shape, dtype, channels_last, training):
    """split_batch_norm_silu: the two channel halves of batch_norm_silu's output, bit for bit, each
    dense in x's layout; the grads and running statistics bit for bit too (its backward reads the
    halves' grads, strided views here, in place); an unused half's grad counts as zeros."""
    x, w, b, rm, rv, dy = make(shape, dtype, channels_last)
    half = shape[1] // 2
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    wa, ba, wb, bb = (t.clone().requires_grad_() for t in (w, b, w, b))
    rma, rva, rmb, rvb = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    y = batch_norm_silu(xa, rma, rva, wa, ba, training, 0.03, 1e-3)
    y0, y1 = bn_silu.split_batch_norm_silu(xb, rmb, rvb, wb, bb, training, 0.03, 1e-3)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for part, want in ((y0, y[:, :half]), (y1, y[:, half:])):
        assert part.is_contiguous(memory_format=fmt) and part.dtype == dtype
        assert torch.equal(part, want)
    assert torch.equal(rma, rmb) and torch.equal(rva, rvb)
    y.backward(dy)
    torch.autograd.backward((y0, y1), (dy[:, :half], dy[:, half:]))
    for a, c in ((xa, xb), (wa, wb), (ba, bb)):
        assert torch.equal(a.grad, c.grad)
    xc = x.clone().requires_grad_()
    _, only = bn_silu.split_batch_norm_silu(xc, rm.clone(), rv.clone(), w, b, training, 0.03, 1e-3)
    only.backward(dy[:, half:])
    xa.grad = None
    batch_norm_silu(xa, rm.clone(), rv.clone(), w, b, training, 0.03, 1e-3).backward(
        torch.cat((torch.zeros_like(dy[:, :half]), dy[:, half:]), 1))
    assert torch.equal(xc.grad, xa.grad)


def test_split_refuses_what_has_no_two_halves():
    x = torch.randn(2, 5, 3, 3, device=DEVICE)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) with an even C; got shape \(2, 5, 3, 3\)"):
        bn_silu.split_batch_norm_silu(x, None, None, training=True)
    with pytest.raises(ValueError, match=r"even C; got shape \(2, 4, 3\)"):
        bn_silu.split_batch_norm_silu(torch.randn(2, 4, 3, device=DEVICE), None, None, training=True)
    cpu = torch.randn(2, 4, 3, 3, dtype=torch.float64)  # torch's path: chunk's halves
    y0, y1 = bn_silu.split_batch_norm_silu(cpu, None, None, training=True)
    assert torch.equal(torch.cat((y0, y1), 1), batch_norm_silu_torch(cpu, None, None, training=True))


def _forced_general(flags):
    """``bn_stats.flags`` made to pick the kernels' general paths: masks, per-element counts,
    channel-by-channel parts, 64-bit offsets."""
    def general(*args, **kwargs):
        chosen = flags(*args, **kwargs)
        chosen.update(EVEN_S=False, MASKED=True, REL32=False)
        if chosen.get("PART") == 1:
            chosen["PART"] = 2
        return chosen
    return general


@pytest.mark.parametrize("split", [False, True], ids=["one", "halves"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_whole_tiles_skip_the_masks_and_give_the_general_paths_bits(monkeypatch, split, channels_last, dtype):
    """Positions that fill whole tiles and channels whole blocks (split at a multiple of the block)
    take the unmasked kernels, with 32-bit tile offsets, counting positions on the host: the same
    bits as the masked, 64-bit, channel-by-channel paths, forward and backward (the two-launch
    forward: test_bn_persist.py checks the one-launch one against it)."""
    monkeypatch.delenv("TRAINFUSE_BN_PERSIST", raising=False)
    shape = (2, 32, 4, 4) if DEVICE.type == "cpu" else (2, 128, 16, 16)  # whole tiles either way
    x, w, b, rm, rv, dy = make(shape, dtype, channels_last)
    chosen = []
    natural = bn_stats.flags
    monkeypatch.setattr(bn_stats, "flags", lambda *a, **k: chosen.append(natural(*a, **k)) or chosen[-1])

    def run():
        xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        rm_, rv_ = rm.clone(), rv.clone()
        if split:
            outs = bn_silu.split_batch_norm_silu(xg, rm_, rv_, wg, bg, True, 0.03, 1e-3)
            torch.autograd.backward(outs, dy.chunk(2, 1))
        else:
            outs = (batch_norm_silu(xg, rm_, rv_, wg, bg, True, 0.03, 1e-3),)
            outs[0].backward(dy)
        return [o.detach() for o in outs] + [xg.grad, wg.grad, bg.grad, rm_, rv_]

    fast = run()
    assert chosen and all(not f["MASKED"] and f["EVEN_S"] and f["REL32"] for f in chosen), chosen
    assert {f.get("PART") for f in chosen} == ({None, 1} if split else {None, 0})
    monkeypatch.setattr(bn_stats, "flags", _forced_general(natural))
    for got, want in zip(run(), fast):
        assert torch.equal(got, want)


def test_the_reduction_tile_from_the_environment_and_its_cap_on_partials(monkeypatch):
    """``TRAINFUSE_BN_REDUCE`` sets channels_last's reduction tile (a bad value is refused, naming
    the variable and the form); ``partials`` caps a channel block's reduction programs."""
    monkeypatch.setenv("TRAINFUSE_BN_REDUCE", "128x32x4x2x8x48")
    cfg = bn_stats._reduce_from_env(BNLaunch(rows=32, channels=64)).reduce
    assert (cfg.rows, cfg.channels, cfg.unroll, cfg.programs_per_sm, cfg.num_warps, cfg.partials) == (
        128, 32, 4, 2, 8, 48)
    for bad in ("64x32x2x4", "64x32x2x4x3", "60x32x2x4x4", "64x32x0x4x4", "axbxcxdxe"):
        monkeypatch.setenv("TRAINFUSE_BN_REDUCE", bad)
        with pytest.raises(ValueError, match="TRAINFUSE_BN_REDUCE=.*ROWSxCHANNELS"):
            bn_stats._reduce_from_env(BNLaunch(rows=32, channels=64))
    cpu = torch.device("cpu")  # 4 SMs' worth of programs there
    free = BNLaunch(rows=4, channels=8, programs_per_sm=8)
    assert bn_stats.split(1000, 1, cpu, free) == (32, 32)
    P, per = bn_stats.split(1000, 1, cpu, dataclasses.replace(free, partials=10))
    assert P <= 10 and P * per >= 1000 and (P - 1) * per < 1000


@pytest.mark.parametrize("split", [False, True], ids=["one", "halves"])
def test_num_batches_tracked_is_counted_inside_the_op(split):
    """A module's counter given to the op moves by 1 a call, as ``nn.BatchNorm2d.forward`` moves it,
    with no launch of its own on the kernels' path; the statistics are the same with or without."""
    x, w, b, rm, rv, _ = make((2, 6, 3, 5), torch.float16, channels_last=True)
    op = bn_silu.split_batch_norm_silu if split else batch_norm_silu
    tracked = torch.tensor(7, device=DEVICE)
    rm2, rv2 = rm.clone(), rv.clone()
    for _ in range(3):
        with_count = op(x, rm, rv, w, b, True, 0.03, 1e-3, num_batches_tracked=tracked)
        without = op(x, rm2, rv2, w, b, True, 0.03, 1e-3)
    assert int(tracked) == 10 and tracked.dtype == torch.long
    for got, want in zip(with_count if split else (with_count,), without if split else (without,)):
        assert torch.equal(got, want)
    assert torch.equal(rm, rm2) and torch.equal(rv, rv2)
