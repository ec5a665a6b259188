"""FusedMLP's cuBLAS path (trainfuse.nn.mlp.library): its two kernels against float64 torch (the
interpreter on CPU), and whole chains forced onto it against nn.Sequential and float64, with grads
assigned, accumulated and returned through autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests._helpers import cuda
from tests.nn._reference import TOL, assert_close_to_reference, reference, rel, rounded, run
from trainfuse.nn import FusedMLP, fuse_mlps
from trainfuse.nn.mlp import launches, library
from trainfuse.nn.mlp.activations import ACTIVATIONS, Layer
from trainfuse.nn.mlp.tiles import MatmulConfigs

# rows x cols: empty, one element, odd, several column blocks, several row parts
MASK_SHAPES = [(0, 8), (1, 1), (37, 33), (64, 130), (203, 257)]


@pytest.fixture
def forced(kernels, monkeypatch):
    """The cuBLAS path for every chain its layers allow, on any device."""
    cfg = MatmulConfigs(library=True)
    monkeypatch.setattr(launches, "config", cfg)
    return cfg


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_mask_and_bias_grad(kernels, device, shape, dtype, relu, bias_dtype):
    g = torch.randn(shape, device=device).to(dtype)
    aux = torch.randn(shape, device=device).to(dtype) if relu else None
    g_before = g.clone()
    for accumulate in (False, True):
        prior = torch.randn(shape[1], device=device)
        bias = None if bias_dtype is None else prior.to(bias_dtype, copy=True)
        masked, want = library.mask_and_bias_grad_reference(
            g, aux, bias.clone() if accumulate and bias is not None else None)
        out = library.mask_and_bias_grad(g, aux, bias, accumulate)
        assert torch.equal(g, g_before), "the upstream grad was written"
        assert out.dtype == dtype and out.shape == g.shape
        assert torch.equal(out, masked)  # a mask: exact
        if not relu:
            assert out is g
        if bias is None:
            continue
        tol = 1e-5 if bias_dtype == torch.float32 else 1e-2
        assert bias.dtype == bias_dtype
        assert (bias.double() - want).abs().max().item() <= tol * (1 + want.abs().max().item())


def test_colsum_is_deterministic(kernels, device):
    g = torch.randn(203, 257, device=device, dtype=torch.bfloat16)
    sums = []
    for _ in range(2):
        b = torch.empty(257, device=device)
        library.mask_and_bias_grad(g, None, b, False)
        sums.append(b)
    assert torch.equal(*sums)


def _chain(sizes, dtype, device, last_activation=True, bias=True):
    torch.manual_seed(0)
    return FusedMLP(sizes, activation="relu", last_activation=last_activation, bias=bias).to(device, dtype)


def _took_library(mlp, x, autocast=None):
    """Whether ``mlp(x)`` (under ``autocast``, a dtype) ran on the cuBLAS path (the output's
    autograd node)."""
    with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = mlp(x.requires_grad_())
    return type(y.grad_fn).__name__ == "LibraryMLPFunctionBackward"


@pytest.mark.parametrize("last_activation,bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,sizes", [(37, [24, 40, 33, 8]), (64, [32, 48, 32]), (1, [16, 24, 16])],
                         ids=str)
def test_chain_matches_sequential_and_float64(forced, device, dtype, rows, sizes, last_activation, bias):
    mlp = _chain(sizes, dtype, device, last_activation, bias)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    x = torch.randn(rows, sizes[0], device=device, dtype=dtype)
    g = torch.randn(rows, sizes[-1], device=device, dtype=dtype)
    assert _took_library(mlp, x.clone())
    assert_close_to_reference(run(mlp, x, g), run(seq, x, g), reference(mlp, x, g), dtype, "library")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_float32_params(forced, device, dtype):
    """float32 params under autocast: 16-bit operands, float32 grads (not rounded through 16 bits)."""
    sizes, rows = [32, 48, 40, 16], 45
    mlp = _chain(sizes, torch.float32, device)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    x = torch.randn(rows, sizes[0], device=device)
    g = torch.randn(rows, sizes[-1], device=device)
    ours = run(mlp, x, g, autocast=dtype)
    assert ours[0].dtype == dtype and all(t.dtype == torch.float32 for t in ours[1:])
    # the reference: what autocast rounds (weights, biases, input) rounded the same way, then float64
    ref = reference(rounded(mlp, dtype), x.to(dtype).float(), g.to(dtype).float())
    assert_close_to_reference(ours, run(seq, x, g, autocast=dtype), ref, dtype, "autocast")


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "autograd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grads_accumulate(forced, device, dtype, fuse):
    """Two backwards onto the same grads, as gradient accumulation does: the sum, whether the
    chain adds into ``.grad`` itself or autograd does."""
    sizes, rows = [24, 40, 16], 29
    mlp = _chain(sizes, dtype, device)
    mlp.fuse_grad_accumulation = fuse
    ref = copy.deepcopy(mlp).double()
    xs = [torch.randn(rows, sizes[0], device=device) for _ in range(2)]
    for x in xs:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            mlp(x).float().sum().backward()
        ref(x.double()).sum().backward()
    for p, r in zip(mlp.parameters(), ref.parameters()):
        assert p.grad.dtype == p.dtype
        assert rel(p.grad, r.grad) <= 4 * TOL[torch.bfloat16]


def test_input_grad_and_frozen_layer(forced, device):
    """Only what is asked for: no input grad for an input without one, none for a frozen layer."""
    mlp = _chain([16, 32, 16], torch.bfloat16, device)
    mlp[0].weight.requires_grad_(False)
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    y = mlp(x)
    assert type(y.grad_fn).__name__ == "LibraryMLPFunctionBackward"
    y.float().sum().backward()
    assert mlp[0].weight.grad is None and mlp[0].bias.grad is not None and mlp[2].weight.grad is not None


def test_eligible(monkeypatch):
    relu, gelu = Layer(ACTIVATIONS["relu"], 0.0), Layer(ACTIVATIONS["gelu"], 0.0)
    none, drop = Layer(ACTIVATIONS["none"], 0.0), Layer(ACTIVATIONS["relu"], 0.1)
    bf = torch.bfloat16
    assert not library.eligible([relu], bf)  # off by default
    monkeypatch.setattr(launches, "config", MatmulConfigs(library=True))
    assert library.eligible([relu, none], bf) and library.eligible([relu], torch.float16)
    assert not library.eligible([relu, gelu], bf)
    assert not library.eligible([drop], bf)
    assert not library.eligible([relu], torch.float32)
    assert not library.eligible([relu], bf, False)  # a chain's own False over the global switch
    monkeypatch.setattr(launches, "config", MatmulConfigs(library=False))
    assert library.eligible([relu], bf, True) and not library.eligible([relu], bf, None)
    assert not library.eligible([relu, gelu], bf, True)


def test_a_chains_own_setting_picks_its_path(kernels, device):
    """``FusedMLP(library=...)`` and ``fuse_mlps(..., library=...)``: the chain's setting, else the
    global switch (off)."""
    x = torch.randn(64, 32, device=device)
    on = FusedMLP([32, 48, 32], activation="relu", library=True).to(device)
    assert on.library is True and "library=True" in repr(on)
    assert _took_library(on, x.clone(), torch.bfloat16)
    off = FusedMLP([32, 48, 32], activation="relu").to(device)
    assert off.library is None and not _took_library(off, x.clone(), torch.bfloat16)
    net = nn.Module()
    net.head = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32)).to(device)
    fuse_mlps(net, library=True)
    assert net.head.library is True and _took_library(net.head, x.clone(), torch.bfloat16)
    with pytest.raises(TypeError, match="library must be True, False or None"):
        FusedMLP([32, 48], library=1)
    del off.__dict__["library"]  # a chain pickled before the switch existed: the global switch
    assert "library=None" in repr(off) and not _took_library(off, x.clone(), torch.bfloat16)


@cuda
@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,width", [(8192, 1024), (65536, 128)])
def test_full_size_chain_on_cublas_matches_torch(rows, width, params, monkeypatch):
    """The benchmark's shapes on the path (eagerly only when asked) match torch under bf16 autocast."""
    mlp = FusedMLP([width] * 4, activation="relu", last_activation=True).cuda().to(params)
    assert not _took_library(mlp, torch.randn(rows, width, device="cuda"), torch.bfloat16)
    monkeypatch.setattr(launches.config, "library", True)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    x = torch.randn(rows, width, device="cuda")
    g = torch.randn(rows, width, device="cuda")
    assert _took_library(mlp, x.clone(), torch.bfloat16)
    ours, same = run(mlp, x, g, autocast=torch.bfloat16), run(seq, x, g, autocast=torch.bfloat16)
    ref = reference(rounded(mlp, torch.bfloat16), x.bfloat16().float(), g)
    # ReLU's grad steps at 0: an element whose pre-activation rounds across 0 flips (see test_mlp_gpu)
    assert_close_to_reference(ours, same, ref, torch.bfloat16, "cublas", factor=3.0)


@cuda
def test_captured_in_a_cuda_graph_replays_the_same(monkeypatch):
    """Captured once and replayed, the path's launches (cuBLAS and ours) give what it gives
    eagerly."""
    mlp = FusedMLP([1024] * 3, activation="relu", last_activation=True).cuda()
    x = torch.randn(8192, 1024, device="cuda")
    params = list(mlp.parameters())
    nodes = []

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mlp(x)
            nodes.append(type(y.grad_fn).__name__)
            return torch.autograd.grad(y.float().sum(), params)

    monkeypatch.setattr(launches.config, "library", True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    assert nodes == ["LibraryMLPFunctionBackward"] * 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))
