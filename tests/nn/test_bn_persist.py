"""trainfuse.nn.bn_persist (``TRAINFUSE_BN_PERSIST=1``): BatchNorm + SiLU's training forward and
backward in one launch each against the two-launch op, bit for bit (outputs, running statistics,
the batch count, dx and the params' grads), one output and C2f's halves (their grads in two
parts), affine or not, with and without running statistics, both layouts, odd sizes, every dtype;
the fallback where the flags would not fit; how many programs fit on an SM. On CPU the
interpreter runs each kernel as two launches (the reduction, then the elementwise pass); on a GPU
the one-launch kernels with their flags."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import cuda, cuda_kernel_names
from tests.nn.test_concat import Parts, ours, run
from trainfuse.nn import bn_persist, bn_silu, bn_stats
from trainfuse.nn.bn_stats import BNLaunch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, C, H, W): odd sizes, channels past a block, batch 1, an even C for the halves
SHAPES = [(2, 6, 5, 7), (1, 10, 4, 9), (3, 70, 2, 3), (2, 32, 4, 4)]


@pytest.fixture(autouse=True)
def small_tiles(kernels, monkeypatch):
    """The kernels (the interpreter on CPU) with test_bn_silu.py's small tiles: several programs
    a channel block, each of several tiles, so that a program applies the tiles it read."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(bn_stats, "CONTIGUOUS", BNLaunch(rows=8, channels=4, programs_per_sm=1))
        reduce = BNLaunch(rows=2, channels=16, programs_per_sm=1, unroll=3)
        monkeypatch.setattr(bn_stats, "CHANNELS_LAST",
                            BNLaunch(rows=4, channels=8, programs_per_sm=1, reduce=reduce))
        monkeypatch.setattr(bn_stats, "FINALIZE_ROWS", 2)


def _make(shape, dtype, channels_last, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g) * 3 + 1.5).to(DEVICE, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = (torch.rand(C, generator=g) + 0.5).to(DEVICE), (torch.randn(C, generator=g) * 0.5).to(DEVICE)
    rm, rv = torch.randn(C, generator=g).to(DEVICE), (torch.rand(C, generator=g) + 0.5).to(DEVICE)
    dy = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return x, w, b, rm, rv, dy


def _run(monkeypatch, persist, x, w, b, rm, rv, dy, split, running, tracked):
    """Forward and backward of the op with the one-launch forward on or off: outputs, grads,
    running statistics and the batch count."""
    monkeypatch.setenv("TRAINFUSE_BN_PERSIST", "1" if persist else "0")
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_() if w is not None else None
    bg = b.clone().requires_grad_() if b is not None else None
    rm_, rv_ = (rm.clone(), rv.clone()) if running else (None, None)
    count = torch.zeros(1, dtype=torch.long, device=DEVICE) if tracked else None
    if split:
        outs = bn_silu.split_batch_norm_silu(xg, rm_, rv_, wg, bg, True, 0.03, 1e-3,
                                             num_batches_tracked=count)
        torch.autograd.backward(outs, dy.chunk(2, 1))
    else:
        outs = (bn_silu.batch_norm_silu(xg, rm_, rv_, wg, bg, True, 0.03, 1e-3, num_batches_tracked=count),)
        outs[0].backward(dy)
    grads = [t.grad for t in (xg, wg, bg) if t is not None]
    return [o.detach() for o in outs] + grads + [t for t in (rm_, rv_, count) if t is not None]


# (shape, channels_last, dtype, split): one output for every shape and layout in float16, the
# halves for a block-aligned and an unaligned split, the other dtypes on one shape
LAYOUTS = (False, True)
CASES = ([(shape, cl, torch.float16, False) for shape in SHAPES for cl in LAYOUTS]
         + [(shape, cl, torch.float16, True) for shape in ((2, 6, 5, 7), (2, 32, 4, 4)) for cl in LAYOUTS]
         + [((2, 6, 5, 7), True, dtype, split) for dtype in (torch.float32, torch.bfloat16)
            for split in (False, True)])


@pytest.mark.parametrize("shape,channels_last,dtype,split", CASES,
                         ids=[f"{s}-{'nhwc' if cl else 'nchw'}-{str(d)[6:]}-{'halves' if sp else 'one'}"
                              for s, cl, d, sp in CASES])
def test_one_launch_gives_the_two_launch_forwards_bits(monkeypatch, shape, channels_last, dtype, split):
    x, w, b, rm, rv, dy = _make(shape, dtype, channels_last)
    kept = x.clone()
    want = _run(monkeypatch, False, x, w, b, rm, rv, dy, split, True, True)
    got = _run(monkeypatch, True, x, w, b, rm, rv, dy, split, True, True)
    assert len(got) == len(want)
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and g.stride() == e.stride() and torch.equal(g, e)
    assert torch.equal(x, kept)


@pytest.mark.parametrize("dtype,channels_last", [(torch.float16, False), (torch.float16, True),
                                                 (torch.bfloat16, True)], ids=["float16-nchw", "float16-nhwc",
                                                                               "bfloat16-nhwc"])
def test_the_concatenations_writer_in_one_launch_each_way(monkeypatch, dtype, channels_last):
    """``batch_norm_silu_into`` (test_concat.py's three parts: a dense half, a shortcut, none) with
    its statistics and writes in one launch, and its sums and grads (the slice's and the dense
    tensor's grads added, the shortcut's grad) in another: the two-launch op's bits."""
    parts = Parts(2, 5, 3, 7, dtype, channels_last, affine=True)
    monkeypatch.setenv("TRAINFUSE_BN_PERSIST", "0")
    out, d1, d2, xs, bns = run(ours, parts, True)
    monkeypatch.setenv("TRAINFUSE_BN_PERSIST", "1")
    launched, launch = [], bn_persist.launch
    monkeypatch.setattr(bn_persist, "launch",
                        lambda kernel, *a: launched.append(kernel.fn.__name__) or launch(kernel, *a))
    out_, d1_, d2_, xs_, bns_ = run(ours, parts, True)
    assert launched.count("into_stats_apply_kernel") == launched.count("into_grad_dx_kernel") == 3
    assert not {"bn_stats_apply_kernel", "bn_grad_dx_kernel"} & set(launched)
    for a, b in zip((out_, d1_, d2_, *(x.grad for x in xs_)), (out, d1, d2, *(x.grad for x in xs))):
        assert torch.equal(a, b)
    for a, b in zip(bns_, bns):  # weight and bias grads, then the running statistics
        assert torch.equal(a[0].grad, b[0].grad) and torch.equal(a[1].grad, b[1].grad)
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


@pytest.mark.parametrize("affine,running,tracked",
                         [(False, True, False), (True, False, False), (False, False, True)],
                         ids=["no-affine", "no-running", "count-only"])
def test_without_affine_running_statistics_or_with_the_count_only(monkeypatch, affine, running, tracked):
    x, w, b, rm, rv, dy = _make((2, 6, 5, 7), torch.float16, True)
    if not affine:
        w = b = None
    want = _run(monkeypatch, False, x, w, b, rm, rv, dy, False, running, tracked)
    got = _run(monkeypatch, True, x, w, b, rm, rv, dy, False, running, tracked)
    for g, e in zip(got, want):
        assert torch.equal(g, e)


def test_more_channel_blocks_than_flags_take_the_two_launches(monkeypatch):
    """Past :data:`~trainfuse.nn.bn_stats.COUNTERS` channel blocks the flags would lie on the
    arrival counters: each direction says so (None, False) before it launches anything, and the
    op runs its two launches."""
    C = bn_stats.COUNTERS * bn_stats.CONTIGUOUS.channels + 2
    x, w, b, rm, rv, dy = _make((2, C, 1, 2), torch.float32, False)
    flat = bn_stats.flat(x)
    y, rm_ = torch.full_like(flat, float("nan")), rm.clone()
    assert bn_persist.forward(flat, y, y.stride(), C, 0, w, b, rm_, rv.clone(), 0.1, 1e-5, None) is None
    assert y.isnan().all() and torch.equal(rm_, rm)  # nothing ran
    consts, sums = torch.ones(4, C, device=DEVICE), torch.zeros(2, C, device=DEVICE)
    dx = torch.full_like(flat, float("nan"))
    assert not bn_persist.backward(flat, flat, flat, C, dx, consts, sums, sums, 0)
    assert dx.isnan().all() and not sums.any()


@pytest.mark.parametrize("regs,shared,warps,per_sm", [(96, 0, 4, 5), (128, 0, 4, 4), (130, 0, 4, 3),
                                                      (40, 0, 4, 12), (32, 0, 8, 8), (64, 100_000, 4, 2)])
def test_programs_resident_at_once(monkeypatch, regs, shared, warps, per_sm):
    """Registers in 256-a-warp steps, threads, shared memory (1 KB reserved a program) and the
    32-program cap, on an H100-like SM (65,536 registers, 2,048 threads, 228 KB)."""
    monkeypatch.setattr(bn_persist, "_sm_limits", lambda index: (132, 65536, 2048, 233472))
    assert bn_persist.resident(regs, shared, warps, 0) == per_sm


@cuda
@pytest.mark.parametrize("shape", [(16, 64, 40, 40), (16, 512, 20, 20), (3, 70, 9, 7)], ids=str)
def test_on_a_gpu_one_kernel_runs_each_way(monkeypatch, shape):
    """The default tiles: one launch each way where its programs fit, the two-launch op's bits."""
    monkeypatch.setattr(bn_stats, "CHANNELS_LAST", bn_stats._reduce_from_env(
        BNLaunch(rows=32, channels=64, reduce=BNLaunch(rows=64, channels=32, unroll=2))))
    x, w, b, rm, rv, dy = _make(shape, torch.float16, True)
    want = _run(monkeypatch, False, x, w, b, rm, rv, dy, False, True, True)
    got = _run(monkeypatch, True, x, w, b, rm, rv, dy, False, True, True)
    for g, e in zip(got, want):
        assert torch.equal(g, e)
    def step():
        xg = x.clone().requires_grad_()
        bn_silu.batch_norm_silu(xg, rm.clone(), rv.clone(), w, b, True).backward(dy)

    names = cuda_kernel_names(step)
    assert any("bn_stats_apply_kernel" in n for n in names) and any("bn_grad_dx_kernel" in n for n in names)
    assert not any(n.startswith(("bn_silu_apply_kernel", "bn_stats_kernel", "bn_silu_grad_sums_kernel",
                                 "bn_silu_dx_kernel")) for n in names)


def test_off_unless_asked_and_in_a_process_group_of_several_ranks(monkeypatch):
    monkeypatch.delenv("TRAINFUSE_BN_PERSIST", raising=False)
    assert not bn_persist.enabled()
    monkeypatch.setenv("TRAINFUSE_BN_PERSIST", "1")
    assert bn_persist.enabled()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert not bn_persist.enabled()
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    assert bn_persist.enabled()
