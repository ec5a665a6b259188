"""FusedMLP against nn.Sequential and a float64 reference, through the kernels (the Triton
interpreter on CPU): forward, input and weight grads, every activation, dropout masks, dtypes,
split-K weight grads, state_dict, from_sequential and fuse_mlps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.nn._reference import TOL, assert_close_to_reference, mlp_reference, reference, rel, rounded, run
from trainfuse.nn import FusedMLP, FuseReport, fuse_mlps
from trainfuse.nn.mlp import buffers, function, launches
from trainfuse.nn.mlp.activations import ACTIVATIONS
from trainfuse.nn.mlp.kernels import EPI_WGRAD
from trainfuse.nn.mlp.tiles import MatmulConfig, MatmulConfigs

ACTS = ["relu", "gelu", "gelu_tanh", "silu", "none"]
# (rows, sizes): odd, non-power-of-two, a single layer, a single row, an unsplit K
SHAPES = [(37, [24, 40, 33, 8]), (64, [32, 48, 32]), (5, [17, 16]), (1, [16, 24, 16])]


@pytest.fixture
def small_tiles(kernels, monkeypatch, device):
    """Kernels forced on, with tiles small enough that these shapes span several programs (on a
    GPU too: small tiles compile in a fraction of the time, and test_mlp_gpu.py runs the default
    launch shapes at real sizes)."""
    t = 16 if device.type == "cpu" else 32
    cfg = MatmulConfigs(forward=MatmulConfig(t, t, t, 4, 2, 2), dgrad=MatmulConfig(t, 2 * t, t, 4, 2, 2),
                        wgrad=MatmulConfig(t, t, t, 4, 2, 2), min_split_k=t, act_block=64)
    monkeypatch.setattr(launches, "config", cfg)
    return cfg


# the matmul's operand order and load path: the weight as B or as A; tiles through TMA tensor
# descriptors where the layout allows (16-byte rows), else pointers
PATHS = {"x_first": dict(weight_first=False), "weight_first": dict(weight_first=True),
         "weight_first_pointers": dict(weight_first=True, tma=False)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rows,sizes", SHAPES, ids=str)
def test_matches_sequential_and_float64(small_tiles, device, act, dtype, rows, sizes, path, monkeypatch):
    for name, value in PATHS[path].items():
        monkeypatch.setattr(small_tiles, name, value)
    mlp = FusedMLP(sizes, activation=act, last_activation=act != "none").to(device, dtype)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    x = torch.randn(rows, sizes[0], device=device, dtype=dtype)
    g = torch.randn(rows, sizes[-1], device=device, dtype=dtype)
    assert_close_to_reference(run(mlp, x, g), run(seq, x, g), reference(mlp, x, g), dtype, act)


@pytest.mark.parametrize("last_activation", [True, False])
def test_last_activation_and_no_bias(small_tiles, device, last_activation):
    mlp = FusedMLP([20, 32, 12], activation="gelu", last_activation=last_activation, bias=False).to(device)
    assert mlp[0].bias is None and isinstance(mlp[-1], nn.GELU) == last_activation
    x, g = torch.randn(9, 20, device=device), torch.randn(9, 12, device=device)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    assert_close_to_reference(run(mlp, x, g), run(seq, x, g), reference(mlp, x, g), torch.float32)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_forward_saves_the_activation_derivative(small_tiles, device, act):
    """GELU/SiLU: the forward stores f'(x W^T + b) beside f(x W^T + b) for the backward, which
    then multiplies by it instead of evaluating erf or exp again; ReLU (whose backward reads the
    output) and no activation have nothing to store and refuse the buffer."""
    x, w = torch.randn(37, 24, device=device), torch.randn(40, 24, device=device)
    b = torch.randn(40, device=device)
    out, deriv = torch.empty(37, 40, device=device), torch.empty(37, 40, device=device)
    launches.linear_forward(x, w, b, out, deriv, torch.float32, ACTIVATIONS[act], 0, 0.0)
    pre = (x.double() @ w.double().t() + b.double()).requires_grad_()
    f = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}[act]
    y = f(pre)
    (want,) = torch.autograd.grad(y.sum(), pre)
    assert rel(out, y.detach()) < 1e-5 and rel(deriv, want) < 1e-5
    for other in ("relu", "none"):
        with pytest.raises(ValueError, match="GELU and SiLU only"):
            launches.linear_forward(x, w, b, out, deriv, torch.float32, ACTIVATIONS[other], 0, 0.0)


@pytest.mark.parametrize("weight_first", [False, True], ids=["x_first", "weight_first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_autocast_float32_params_and_input(small_tiles, device, dtype, weight_first, monkeypatch):
    """Under autocast: float32 weights are read as stored and rounded in the kernel, the float32
    input is rounded once (as autocast would); the output is in the autocast dtype, the grads in
    the params' and input's float32."""
    monkeypatch.setattr(small_tiles, "weight_first", weight_first)
    mlp = FusedMLP([32, 48, 16], activation="silu", last_activation=True).to(device)
    x, g = torch.randn(40, 32, device=device), torch.randn(40, 16, device=device)
    ours = run(mlp, x, g, autocast=dtype)
    assert ours[0].dtype == dtype and all(t.dtype == torch.float32 for t in ours[1:])
    # reference: the operands autocast rounds (weights, input) rounded the same way, then float64
    ref = reference(rounded(mlp, dtype), x.to(dtype).float(), g)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    assert_close_to_reference(ours, run(seq, x, g, autocast=dtype), ref, dtype, "autocast")


@pytest.mark.parametrize("weight_first", [False, True], ids=["x_first", "weight_first"])
@pytest.mark.parametrize("act", ["relu", "gelu", "silu", "none"])
def test_dropout_mask_is_regenerated_in_backward(small_tiles, device, act, weight_first, monkeypatch):
    """The backward applies the very mask the forward drew, without storing it (read back from
    the saved output or derivative; drawn again from the seed with no activation): output and
    grads equal a float64 chain run with the masks that dropout_mask() returns. The module first
    runs with another p: a changed Dropout.p must take effect (scale included)."""
    monkeypatch.setattr(small_tiles, "weight_first", weight_first)
    p = 0.3
    mlp = FusedMLP([24, 40, 33, 8], activation=act, last_activation=True, dropout=0.1).to(device).train()
    x, g = torch.randn(29, 24, device=device), torch.randn(29, 8, device=device)
    run(mlp, x, g)
    for m in mlp:
        if isinstance(m, nn.Dropout):
            m.p = p
    ours = run(mlp, x, g)
    seed = mlp._last_seed
    masks = [launches.dropout_mask(seed + i, (29, lin.out_features), p, device)
             for i, lin in enumerate(m for m in mlp if isinstance(m, nn.Linear))]
    kept = torch.cat([m.flatten() for m in masks]).float().mean().item()
    assert 0.6 < kept < 0.8  # about 1 - p of the elements are kept
    lins = [m for m in mlp if isinstance(m, nn.Linear)]
    ws = [lin.weight.detach().double().requires_grad_() for lin in lins]
    bs = [lin.bias.detach().double().requires_grad_() for lin in lins]
    x64 = x.double().requires_grad_()
    y = mlp_reference(x64, ws, bs, [act] * 3, masks, [p] * 3)
    y.backward(g.double())
    ref = [y, x64.grad] + [t.grad for pair in zip(ws, bs) for t in pair]
    for name, a, r in zip(["output", "input grad", "w0", "b0", "w1", "b1", "w2", "b2"], ours, ref):
        assert rel(a, r) < 1e-5, f"{name}: {rel(a, r):.2e}"


def test_dropout_draws_new_masks_and_follows_the_torch_seed(small_tiles, device):
    mlp = FusedMLP([16, 32, 16], dropout=0.5, last_activation=True).to(device)
    x = torch.randn(8, 16, device=device)
    torch.manual_seed(7)
    a = mlp(x)
    b = mlp(x)
    torch.manual_seed(7)
    c = mlp(x)
    assert not torch.equal(a, b) and torch.equal(a, c)
    mlp.eval()  # no dropout: the plain chain
    seq = nn.Sequential(*[m for m in mlp.children() if not isinstance(m, nn.Dropout)])
    assert rel(mlp(x), seq(x)) < 1e-6
    mlp.train()
    for m in mlp:  # the Dropout children's own mode counts, as in nn.Sequential
        if isinstance(m, nn.Dropout):
            m.eval()
    assert mlp.training and rel(mlp(x), seq(x)) < 1e-6


def test_split_k_weight_grad_is_right_and_deterministic(small_tiles, device, monkeypatch):
    """A long batch against a small weight: the weight grad splits the batch over several
    programs per tile and the last one adds the partials in a fixed order."""
    monkeypatch.setattr(launches.config, "wave_programs", 64)
    monkeypatch.setattr(launches.config, "min_split_k", 16)
    splits = []
    launch = launches.launcher

    class Spy:  # on a GPU the repeated call below launches from bound sites, past the spy
        def __call__(self, fn, grid, *args, **kw):
            if kw.get("EPI") == EPI_WGRAD:
                splits.append(args[13])  # nsplit
            return launch(fn, grid, *args, **kw)

        def __getattr__(self, name):
            return getattr(launch, name)

    monkeypatch.setattr(launches, "launcher", Spy())
    mlp = FusedMLP([16, 24, 8], activation="relu").to(device)
    x, g = torch.randn(150, 16, device=device), torch.randn(150, 8, device=device)
    first = run(mlp, x, g)
    assert max(splits) > 1
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    assert_close_to_reference(first, run(seq, x, g), reference(mlp, x, g), torch.float32, "split-K")
    again = run(mlp, x, g)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_split_k_and_loss_reductions_share_the_stream_scratch(small_tiles, device, monkeypatch):
    """Split-K weight grads and the losses' one-launch sums use the same per-stream scratch and
    arrival counters (trainfuse._runtime.launch.stream_workspace), interleaved and growing: each
    re-arms its counters, so every result stays right and bit-reproducible. One stream (with two,
    the weight grads would run on the side stream, which has its own scratch)."""
    from trainfuse._runtime import launch
    from trainfuse.losses import bce_with_logits

    monkeypatch.setattr(launch, "_workspaces", {})  # start empty: the calls below grow it
    monkeypatch.setattr(launches.config, "wave_programs", 64)
    monkeypatch.setattr(launches.config, "min_split_k", 16)
    logits, targets = torch.randn(40, 37, device=device), torch.rand(40, 37, device=device)
    want_loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), targets.double())
    results = []
    for width in (8, 24):  # the wider net needs more partial tiles: the scratch grows
        mlp = FusedMLP([16, width, 8], activation="relu", streams=1).to(device)
        x, g = torch.randn(150, 16, device=device), torch.randn(150, 8, device=device)
        seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
        for _ in range(2):
            loss = bce_with_logits(logits, targets)
            torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-7)
            got = run(mlp, x, g)
            assert_close_to_reference(got, run(seq, x, g), reference(mlp, x, g), torch.float32, "shared")
            results.append(got)
        assert all(torch.equal(a, b) for a, b in zip(results[-2], results[-1]))
    (scratch, counters), = [v for k, v in launch._workspaces.items() if k[2] == torch.float32]
    assert not counters.any()  # every counter re-armed


@pytest.mark.parametrize("act,p", [("gelu", 0.0), ("silu", 0.2), ("gelu_tanh", 0.0), ("relu", 0.2)])
def test_recompute_gives_the_same_bits_and_keeps_less(small_tiles, device, act, p):
    """recompute=True: the backward runs each GELU/SiLU layer's forward matmul again for its
    derivative instead of the forward keeping it. Output and every grad equal recompute=False's
    bit for bit (dropout masks included), and what autograd holds from forward to backward
    shrinks by exactly the derivatives (rows x width per layer), less the biases the recompute
    reads. ReLU keeps only its outputs either way."""
    kept = FusedMLP([24, 40, 33, 8], activation=act, last_activation=True, dropout=p).to(device)
    again = FusedMLP.from_sequential(kept, recompute=True)
    assert "recompute=True" in repr(again)
    x, g = torch.randn(29, 24, device=device), torch.randn(29, 8, device=device)
    results, held = [], []
    for mlp in (kept, again):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel())
            return t

        torch.manual_seed(7)  # the same dropout seed for both
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results.append(run(mlp, x, g))
        held.append(sum(sizes))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    widths = 40 + 33 + 8
    assert held[0] - held[1] == (0 if act == "relu" else 29 * widths - widths)
    with pytest.raises(TypeError, match="recompute must be a bool"):
        FusedMLP([8, 8], recompute="yes")
    with pytest.raises(TypeError, match="fuse_grad_accumulation must be a bool"):
        FusedMLP([8, 8], fuse_grad_accumulation=1)


def test_input_without_grad_and_frozen_layer(small_tiles, device):
    mlp = FusedMLP([16, 32, 16, 8], activation="gelu_tanh").to(device)
    mlp[2].weight.requires_grad_(False)
    x = torch.randn(12, 16, device=device)  # no requires_grad
    mlp(x).square().sum().backward()
    assert mlp[2].weight.grad is None and mlp[2].bias.grad is not None
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children()))).double()
    seq(x.double()).square().sum().backward()
    for ours, ref in zip(mlp.parameters(), seq.parameters()):
        assert (ours.grad is None) == (ref.grad is None)
        if ref.grad is not None:
            assert rel(ours.grad, ref.grad) < 1e-5


def test_leading_dims_and_non_contiguous_input(small_tiles, device):
    mlp = FusedMLP([16, 24, 8], activation="relu").to(device)
    x = torch.randn(3, 16, 7, device=device).transpose(1, 2)  # (3, 7, 16), not contiguous
    g = torch.randn(3, 7, 8, device=device)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    ours = run(mlp, x, g)
    assert ours[0].shape == (3, 7, 8) and ours[1].shape == x.shape
    assert_close_to_reference(ours, run(seq, x, g), reference(mlp, x, g), torch.float32)


def _spy_direct(monkeypatch) -> list:
    """Records what each backward's :func:`trainfuse.nn.mlp.grads.direct_grads` decided, per layer:
    None (grads back through autograd), "assign" or "add"."""
    seen = []
    real = function.direct_grads

    def spy(*args):
        out = real(*args)
        seen.append(None if out is None else [None if d is None else "add" if d[2] else "assign"
                                              for d in out])
        return out

    monkeypatch.setattr(function, "direct_grads", spy)
    return seen


@pytest.mark.parametrize("rows", [21, 70], ids=["one_program_per_tile", "split_k"])
@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_grads_accumulate_like_torch(small_tiles, device, dtype, streams, rows, monkeypatch):
    """Backward onto existing grads adds to them in the weight-grad kernel, in place as autograd
    does (the same .grad tensors), the sum formed in float32 and rounded once: as close to the
    float64 sum as autograd's add of the two grads. The first backward assigns the grads it
    writes."""
    seen = _spy_direct(monkeypatch)
    mlp = FusedMLP([16, 24, 40, 8], activation="gelu", streams=streams).to(device, dtype)
    xs = [torch.randn(rows, 16, device=device, dtype=dtype) for _ in range(2)]
    gs = [torch.randn(rows, 8, device=device, dtype=dtype) for _ in range(2)]
    apart = FusedMLP.from_sequential(copy.deepcopy(mlp), streams, fuse_grad_accumulation=False)
    singles = [run(apart, x, g)[2:] for x, g in zip(xs, gs)]  # each backward onto no grads
    seen.clear()
    mlp.zero_grad(set_to_none=True)
    mlp(xs[0]).backward(gs[0])
    first = [p.grad for p in mlp.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first, singles[0]))
    mlp(xs[1]).backward(gs[1])
    assert seen == [["assign"] * 3, ["add"] * 3]
    assert all(p.grad is a for p, a in zip(mlp.parameters(), first))  # in place
    second = reference(mlp, xs[1], gs[1])[2:]  # float64 grads of the second backward
    for i, (p, a, b, r) in enumerate(zip(mlp.parameters(), singles[0], singles[1], second)):
        want = a.double() + r
        limit = max(TOL[dtype], 2 * rel(a + b, want))
        assert rel(p.grad, want) <= limit, f"param {i}: {rel(p.grad, want):.2e} > {limit:.2e}"


def test_a_chain_called_twice_in_one_graph_sums_its_grads(small_tiles, device, monkeypatch):
    """Two calls of one chain before one backward: two backward nodes write the same params'
    grads, the first assigning, the second adding to what the first wrote (and a third term of
    the same weight goes through autograd on top)."""
    seen = _spy_direct(monkeypatch)
    mlp = FusedMLP([16, 24, 8], activation="relu").to(device)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children()))).double()
    x1, x2 = torch.randn(19, 16, device=device), torch.randn(23, 16, device=device)

    def loss(model, a, b):
        return model(a).square().sum() + model(b).sum() + model[0].weight.sum()

    loss(mlp, x1, x2).backward()
    loss(seq, x1.double(), x2.double()).backward()
    assert sorted(map(tuple, seen)) == [("add", "add"), ("assign", "assign")]
    for ours, ref in zip(mlp.parameters(), seq.parameters()):
        assert rel(ours.grad, ref.grad) < 1e-5


def test_grads_go_through_autograd_where_it_would_tell(small_tiles, device, monkeypatch):
    """Where writing .grad directly would differ from autograd (autograd.grad, backward(inputs=),
    hooks, create_graph, a grad that is not row-major, one layer's grads half there) the grads
    take autograd's path, with autograd's results."""
    seen = _spy_direct(monkeypatch)
    mlp = FusedMLP([16, 24, 8], activation="silu").to(device)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children()))).double()
    x = torch.randn(30, 16, device=device)
    w0, b0, w1, b1 = mlp.parameters()

    def loss(model, xx):
        out = model(xx)
        return out.square().sum() + (model[0].weight * 0.5).sum()  # w0 used twice

    def expected():
        seq.zero_grad(set_to_none=True)
        loss(seq, x.double()).backward()
        return [p.grad.clone() for p in seq.parameters()]

    ref = expected()
    grads = torch.autograd.grad(loss(mlp, x), [w0, b1])
    assert all(p.grad is None for p in mlp.parameters())
    assert rel(grads[0], ref[0]) < 1e-5 and rel(grads[1], ref[3]) < 1e-5
    assert seen[-1] == [None, None]

    loss(mlp, x).backward(inputs=[w0, b0, w1])
    assert seen[-1] == ["assign", None] and b1.grad is None
    assert all(rel(p.grad, r) < 1e-5 for p, r in zip((w0, b0, w1), ref))

    calls = []
    mlp.zero_grad(set_to_none=True)
    w1.register_hook(lambda g: g * 2)
    b1.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    w0.grad = torch.zeros_like(w0)
    b0.grad = torch.zeros(24, 2, device=device)[:, 0]  # strided: added by autograd
    with warnings.catch_warnings():  # "grad and param do not obey the gradient layout contract"
        warnings.simplefilter("ignore")
        loss(mlp, x).backward()
    assert seen[-1] == [None, None]
    assert rel(w1.grad, 2 * ref[2]) < 1e-5 and len(calls) == 1 and rel(calls[0], ref[3]) < 1e-5
    assert rel(w0.grad, ref[0]) < 1e-5 and rel(b0.grad, ref[1]) < 1e-5

    mlp2 = FusedMLP.from_sequential(copy.deepcopy(seq).float())
    mlp2[0].weight.grad = torch.ones_like(mlp2[0].weight)  # the bias grad is None: not both
    loss(mlp2, x).backward()
    assert seen[-1] == [None, "assign"]
    assert rel(mlp2[0].weight.grad, ref[0] + 1) < 1e-5

    mlp2.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # create_graph=True: "a reference cycle ... and its gradient"
        warnings.simplefilter("ignore")
        loss(mlp2, x).backward(create_graph=True)
    assert seen[-1] is None
    assert all(rel(p.grad, r) < 1e-5 for p, r in zip(mlp2.parameters(), ref))
    mlp2.zero_grad(set_to_none=True)

    off = FusedMLP.from_sequential(copy.deepcopy(seq).float(), fuse_grad_accumulation=False)
    asked = len(seen)
    loss(off, x).backward()
    loss(off, x).backward()
    assert len(seen) == asked  # the switch is off: never asked
    assert all(rel(p.grad, 2 * r) < 1e-5 for p, r in zip(off.parameters(), ref))


def test_param_grads_are_taken_without_copies_and_keep_the_weight_layout(small_tiles, device):
    """The weight and bias grads are carved from one allocation per dtype and autograd takes them
    as the params' .grad as they are (a copy would give each its own storage); a weight stored
    column-major gets a grad of its own layout."""
    mlp = FusedMLP([16, 24, 32, 8], activation="silu").to(device)
    mlp[2].weight = nn.Parameter(mlp[2].weight.detach().t().contiguous().t())
    x, g = torch.randn(19, 16, device=device), torch.randn(19, 8, device=device)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    ours = run(mlp, x, g)
    assert_close_to_reference(ours, run(seq, x, g), reference(mlp, x, g), torch.float32)
    shared = [p for p in mlp.parameters() if p is not mlp[2].weight]
    assert len({p.grad.untyped_storage().data_ptr() for p in shared}) == 1
    assert mlp[2].weight.grad.stride() == mlp[2].weight.stride() == (1, 32)
    assert all(p.grad.is_contiguous() for p in shared)


def test_one_stream_input_grads_take_turns_in_two_slices():
    """With one stream the backward's input grads alternate between two slices of one buffer (as
    many held at a time as when each had its own allocation): neighbours never overlap, every
    other one starts where the first does, and the buffer is the two largest of each turn."""
    shapes = [(5, 8), (5, 24), (5, 16), (5, 40), (5, 8)]
    views = buffers.alternating(shapes, torch.float16, torch.device("cpu"))
    assert [tuple(v.shape) for v in views] == shapes and all(v.is_contiguous() for v in views)
    base = views[0].untyped_storage().data_ptr()
    starts = [v.data_ptr() - base for v in views]
    assert starts[0] == starts[2] == starts[4] == 0 and starts[1] == starts[3] > 0
    assert starts[1] >= 5 * 16 * 2 and starts[1] % 128 == 0  # after the largest even-turn tensor
    assert views[0].untyped_storage().nbytes() == starts[1] + 5 * 40 * 2
    for a, b in zip(views, views[1:]):  # written one after the other: disjoint memory
        a.fill_(1.0)
        b.fill_(2.0)
        assert (a == 1.0).all()


def test_ddp_gradient_hooks(small_tiles, device, tmp_path, monkeypatch):
    """Under DistributedDataParallel (one process) the grads DDP's hooks reduce are ours; under a
    process group they go back through autograd (hooks Python cannot see may be on the params'
    AccumulateGrad nodes), also onto existing grads."""
    import torch.distributed as dist

    seen = _spy_direct(monkeypatch)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mlp = FusedMLP([16, 32, 8], activation="relu").to(device)
        ddp = nn.parallel.DistributedDataParallel(mlp)
        x, g = torch.randn(10, 16, device=device), torch.randn(10, 8, device=device)
        seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
        ours = run(ddp, x, g)
        assert_close_to_reference(ours, run(seq, x, g), reference(mlp, x, g), torch.float32, "DDP")
        once = [t.clone() for t in ours[2:]]
        ddp(x).backward(g)
        assert all(rel(p.grad, 2 * r) < 1e-5 for p, r in zip(mlp.parameters(), once))
        assert seen == [None, None]
    finally:
        dist.destroy_process_group()


def test_streams_setting_gives_identical_results(small_tiles, device):
    mlp = FusedMLP([16, 32, 32, 8], activation="gelu", streams=1).to(device)
    x, g = torch.randn(33, 16, device=device), torch.randn(33, 8, device=device)
    one = run(mlp, x, g)
    two = run(FusedMLP.from_sequential(mlp, streams=2), x, g)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


# ---- module contract ------------------------------------------------------------------------------
def test_state_dict_keys_equal_the_plain_sequential():
    mlp = FusedMLP([8, 16, 16, 4], activation="gelu", dropout=0.1)
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 16), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(16, 4))
    assert list(mlp.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(mlp.state_dict())
    mlp.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(mlp.state_dict().values(), plain.state_dict().values()))


def test_from_sequential_shares_the_parameters():
    seq = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    fused = FusedMLP.from_sequential(seq)
    assert [id(p) for p in fused.parameters()] == [id(p) for p in opt.param_groups[0]["params"]]
    assert list(fused.state_dict()) == list(seq.state_dict())


@pytest.mark.parametrize("bad,match", [
    (nn.Sequential(nn.ReLU(), nn.Linear(4, 4)), "comes before the first Linear"),
    (nn.Sequential(nn.Linear(4, 8), nn.Linear(4, 4)), "does not take the 8 features"),
    (nn.Sequential(nn.Linear(4, 4), nn.Tanh()), "Tanh"),
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.GELU()), "after an activation"),
    (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1, inplace=True)), "inplace"),
    (nn.Sequential(), "no Linear"),
])
def test_from_sequential_refuses_other_chains(bad, match):
    with pytest.raises(ValueError, match=match):
        FusedMLP.from_sequential(bad)


@pytest.mark.parametrize("kwargs,match", [
    ({"sizes": [8, 8], "activation": "tanh"}, "activation must be one of"),
    ({"sizes": [8]}, "at least"),
    ({"sizes": [8, 8], "dropout": 1.5}, "dropout"),
    ({"sizes": [8, 8], "streams": 3}, "streams"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedMLP(**kwargs)


def test_fuse_mlps_swaps_whole_chains_and_reports_the_rest():
    torch.manual_seed(0)
    model = nn.Module()
    model.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
    model.mixed = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU())
    model.tanh = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    model.convs = nn.Sequential(nn.Conv1d(2, 2, 1), nn.ReLU())  # no Linear: not a candidate
    model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU(approximate="tanh"))])
    model.hooked = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    model.hooked[0].register_forward_hook(lambda *a: None)
    params = {id(p) for p in model.parameters()}
    keys = list(model.state_dict())
    x = torch.randn(4, 8)
    before = model.head.eval()(x)
    report = fuse_mlps(model)
    assert isinstance(report, FuseReport)
    assert sorted(report.swapped) == ["blocks.0", "head"]
    skipped = dict(report.skipped)
    assert set(skipped) == {"mixed", "tanh", "hooked"}
    assert "LayerNorm" in skipped["mixed"] and "Tanh" in skipped["tanh"] and "hooks" in skipped["hooked"]
    assert type(model.head) is FusedMLP and type(model.blocks[0]) is FusedMLP
    assert type(model.mixed) is nn.Sequential
    assert {id(p) for p in model.parameters()} == params and list(model.state_dict()) == keys
    # the same math, not always the same rounding: the fused path's GEMM may block its sums otherwise
    torch.testing.assert_close(model.head(x), before)
    assert "swapped head" in str(report) and "skipped mixed" in str(report)
    # the FusedMLP options reach every swapped chain
    other = nn.Module()
    other.head = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))
    fuse_mlps(other, streams=1, recompute=True, fuse_grad_accumulation=False)
    assert (other.head.streams, other.head.recompute, other.head.fuse_grad_accumulation) == (1, True, False)


def test_fuse_mlps_on_a_chain_itself():
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    report = fuse_mlps(seq)
    assert report.swapped == [] and "from_sequential" in report.skipped[0][1]


def test_cpu_tensors_take_torch_path_by_default(monkeypatch):
    """TRAINFUSE_BACKEND=auto on CPU: the plain nn.Sequential forward, bit for bit; so does
    float64 with the kernels forced."""
    monkeypatch.setenv("TRAINFUSE_BACKEND", "auto")
    called = []
    monkeypatch.setattr(launches, "matmul", lambda *a, **k: called.append(1))
    mlp = FusedMLP([8, 16, 4], activation="gelu")
    seq = nn.Sequential(*mlp.children())
    x = torch.randn(5, 8)
    assert torch.equal(mlp(x), seq(x))
    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    mlp64 = copy.deepcopy(mlp).double()
    assert torch.equal(mlp64(x.double()), nn.Sequential(*mlp64.children())(x.double()))
    assert called == []


def test_empty_batch(small_tiles, device):
    mlp = FusedMLP([8, 16, 4]).to(device)
    x = torch.randn(0, 8, device=device, requires_grad=True)
    y = mlp(x)
    y.sum().backward()
    assert y.shape == (0, 4) and x.grad.shape == (0, 8)
