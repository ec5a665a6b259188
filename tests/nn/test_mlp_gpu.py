"""What only a CUDA device can show: bf16 tensor-core kernels, the two-stream backward under a
delayed side stream, CUDA-graph capture, GradScaler, and the auto backend's fallback choice."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests._helpers import cuda
from tests.nn._reference import assert_close_to_reference, reference, rel, rounded, run
from trainfuse._runtime import launch as L
from trainfuse.nn import FusedMLP
from trainfuse.nn.mlp import function, launches, tiles
from trainfuse.nn.mlp.activations import ACTIVATIONS
from trainfuse.nn.mlp.kernels import EPI_ACT_GRAD, EPI_FORWARD, EPI_WGRAD
from trainfuse.nn.mlp.tiles import MatmulConfig


@cuda
@pytest.mark.parametrize("act", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("rows,width", [(512, 256), (300, 160), (2048, 1024)])
def test_bf16_autocast_matches_torch(act, rows, width):
    mlp = FusedMLP([width, width, width, width // 2], activation=act, last_activation=True).cuda()
    x = torch.randn(rows, width, device="cuda")
    g = torch.randn(rows, width // 2, device="cuda")
    ours = run(mlp, x, g, autocast=torch.bfloat16)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    ref = reference(rounded(mlp, torch.bfloat16), x.bfloat16().float(), g)
    # ReLU's grad is a step at 0: a pre-activation that rounds across 0 flips an element's grad,
    # so a bf16 chain's error against float64 is a handful of flips, and an equally exact chain
    # may have twice torch's (seen once in 540 cases: a last-layer bias grad at 2.03x)
    factor = 3.0 if act == "relu" else 2.0
    assert_close_to_reference(ours, run(seq, x, g, autocast=torch.bfloat16), ref, torch.bfloat16, act, factor)


class _DelayingEvent(torch.cuda.Event):
    """An event after whose every wait on ``side`` that stream sleeps ``cycles`` (torch.cuda._sleep):
    the backward's side stream waits on such an event before each weight grad."""

    side: torch.cuda.Stream
    cycles: int

    def wait(self, stream=None) -> None:
        super().wait(stream)
        if stream is self.side:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(self.cycles)


def _delay_side_stream(monkeypatch, cycles: int) -> None:
    """The backward's side stream sleeps ``cycles`` before each weight grad (after waiting for the
    main stream), so the main stream races ahead."""
    real = function._side_stream

    def delayed(device, events):
        side, _ = real(device, events)
        delaying = [_DelayingEvent() for _ in range(events)]
        for event in delaying:
            event.side, event.cycles = side, cycles
        return side, delaying

    monkeypatch.setattr(function, "_side_stream", delayed)


@cuda
@pytest.mark.parametrize("set_to_none", [True, False])
def test_side_stream_delayed_grads_still_right(set_to_none, monkeypatch):
    """The side stream sleeps before every weight grad: the main stream races ahead, frees and
    reallocates memory and returns; the grads must still be the ones a single stream computes.
    With ``set_to_none=False`` the main stream zeroes the existing grads and the side stream
    adds to them in place: it must wait for the zeroing."""
    mlp = FusedMLP([512, 1024, 1024, 1024, 512], activation="gelu", last_activation=True, streams=1).cuda()
    x = torch.randn(4096, 512, device="cuda")
    g = torch.randn(4096, 512, device="cuda")
    want = [t.clone() for t in run(mlp, x, g, autocast=torch.bfloat16)]  # the loop adds to the grads
    two = FusedMLP.from_sequential(mlp, streams=2)
    _delay_side_stream(monkeypatch, 20_000_000)
    for _ in range(3):
        xx = x.clone().requires_grad_()
        two.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = two(xx)
        y.backward(g.bfloat16())
        # no synchronize: read the grads on the main stream right away, and churn the allocator
        got = [y.detach(), xx.grad] + [p.grad for p in two.parameters()]
        junk = [torch.full((4096, 1024), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        got = [t.clone() for t in got]
        del junk
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@cuda
@pytest.mark.parametrize("streams", [1, 2])
def test_forward_backward_captured_in_cuda_graph(streams):
    """Both streams' kernels in one graph. At these widths every matmul reads its operands through
    TMA descriptors, written per launch to scratch memory: with two streams the replay runs a
    weight grad and an input grad at once, and hung when their scratch was the same memory."""
    mlp = FusedMLP([256, 512, 256], activation="relu", last_activation=True, streams=streams).cuda()
    x = torch.randn(1024, 256, device="cuda", requires_grad=True)
    g = torch.randn(1024, 256, device="cuda")
    want = run(mlp, x, g, autocast=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: compiles, workspaces
            mlp.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = mlp(x)
            y.backward(g.bfloat16())
    torch.cuda.current_stream().wait_stream(side)
    for p in mlp.parameters():
        p.grad = torch.zeros_like(p)
    x.grad = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mlp(x)
        y.backward(g.bfloat16())
    for _ in range(2):
        for t in [x, *mlp.parameters()]:
            t.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@cuda
def test_grad_scaler_fp16():
    mlp = FusedMLP([256, 256, 256, 64], activation="relu").cuda()
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    x = torch.randn(512, 256, device="cuda")
    outs = []
    for model in (mlp, seq):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14)
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        outs.append([p.detach().clone() for p in model.parameters()] + [scaler.get_scale()])
    for a, b in zip(outs[0][:-1], outs[1][:-1]):
        assert rel(a, b) < 1e-3
    assert outs[0][-1] == outs[1][-1]


@cuda
def test_auto_backend_takes_torch_for_odd_sizes_and_tiny_batches(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "auto")
    calls = []
    real = launches.matmul
    monkeypatch.setattr(launches, "matmul", lambda *a, **k: (calls.append(1), real(*a, **k)))
    for sizes, rows, fused in [([64, 64], 128, True), ([60, 64], 128, False), ([64, 64], 8, False)]:
        calls.clear()
        FusedMLP(sizes).cuda()(torch.randn(rows, sizes[0], device="cuda"))
        assert bool(calls) == fused, (sizes, rows)


@cuda
def test_float32_follows_torch_tf32_switch(monkeypatch):
    mlp = FusedMLP([256, 256, 256], activation="relu").cuda()
    x, g = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ours = run(mlp, x, g)
    ref = reference(mlp, x, g)
    assert all(rel(a, r) < 1e-5 for a, r in zip(ours, ref))


# input layouts for the bound-launch test: (base tensor's shape, the view of it the chain reads)
_LAYOUTS = {
    "contiguous": ((512, 256), lambda t: t),
    "transposed": ((256, 512), lambda t: t.t()),
    "misaligned by one element": ((512 * 256 + 1,), lambda t: t[1:].view(512, 256)),  # no TMA: pointers
    "another batch": ((384, 256), lambda t: t),
}


def _run_view(model, base, view, g):
    """Output and the grads of ``base`` and of every param, the chain reading ``view(base)``."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=base.dtype == torch.float32):
        y = model(view(base))
    return [y.detach(), *torch.autograd.grad(y, [base, *model.parameters()], g.to(y.dtype))]


@cuda
@pytest.mark.parametrize("streams", [1, 2])
def test_repeated_calls_launch_bound_sites_and_follow_layout_changes(streams, monkeypatch):
    """From its second call with a given signature a chain launches every kernel straight from
    its bound launch sites (trainfuse.nn.mlp.launches._chains), keying nothing per launch. An input with
    another layout (transposed, misaligned, another batch) is another signature with sites of its
    own; every call, first or repeated, matches torch and a float64 reference. A bf16 chain on
    bf16 inputs: a float32 input under autocast is cast first, into a fresh aligned tensor."""
    monkeypatch.setattr(launches, "_chains", {})
    mlp = FusedMLP([256, 256, 128], activation="relu", last_activation=True, streams=streams)
    mlp = mlp.cuda().bfloat16()
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    ref_mlp = rounded(mlp, torch.bfloat16).double()
    for name in [*_LAYOUTS, *_LAYOUTS]:  # each twice: the second call runs on bound sites
        shape, view = _LAYOUTS[name]
        base = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(view(base).shape[0], 128, device="cuda")
        ours = _run_view(mlp, base, view, g)
        ref = _run_view(ref_mlp, base.detach().bfloat16().double().requires_grad_(), view, g.double())
        assert_close_to_reference(ours, _run_view(seq, base, view, g), ref, torch.bfloat16, name)
    assert len(launches._chains) == 2 * len(_LAYOUTS)  # a forward and a backward signature per layout
    assert all(site.run is not None for sites in launches._chains.values() for site in sites)


@cuda
@pytest.mark.parametrize("act,recompute", [("relu", False), ("gelu", True)])
def test_repeated_launches_replay_as_cuda_graphs_with_the_same_results(act, recompute, monkeypatch):
    """Once a chain's forward, or its one-stream backward, repeats a list of launches it made
    before (the same kernels, grids, addresses and scalars: ``ChainSites.replays``), it is
    captured and from then on replayed as one CUDA graph. Every call's output and grads equal,
    bit for bit, those of launching each kernel (config.graphs False), over inputs at two
    alternating addresses and grads accumulating in .grad."""
    monkeypatch.setattr(launches, "_chains", {})
    replays = []
    real_capture = L._capture

    def counting_capture(*args):
        entry = real_capture(*args)
        assert entry is not None, "capture failed"

        class Counted:
            def replay(self):
                replays.append(1)
                entry[0].replay()

        return Counted(), entry[1]

    monkeypatch.setattr(L, "_capture", counting_capture)
    mlp = FusedMLP([256, 512, 512, 256], activation=act, last_activation=True, recompute=recompute,
                   streams=1).cuda()
    twin = copy.deepcopy(mlp)
    xs = [torch.randn(1024, 256, device="cuda") for _ in range(2)]
    g = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)

    def steps(model):
        outs = []
        for i in range(8):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(xs[i % 2])
            y.backward(g)
            # copied to the host: a copy kept on the GPU would move the next call's buffers
            outs.append([y.detach().cpu(), *(p.grad.cpu() for p in model.parameters())])
        return outs

    got = steps(mlp)
    monkeypatch.setattr(launches.config, "graphs", False)
    want = steps(twin)
    assert len(replays) >= 6  # from the 4th call on, forward and backward: 10 when addresses repeat
    for i, (a, b) in enumerate(zip(got, want)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"call {i}"


@cuda
def test_a_failed_capture_warns_once_and_launches_kernel_by_kernel(monkeypatch):
    """Where a chain pass's launches cannot be captured, it says so once per launch list (at most
    4 a pass) and launches that list one by one from then on, with the same results."""
    monkeypatch.setattr(launches, "_chains", {})

    def refuse(self, *args, **kwargs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
    mlp = FusedMLP([256, 512, 256], activation="relu", last_activation=True, streams=1).cuda()
    twin = copy.deepcopy(mlp)
    x = torch.randn(1024, 256, device="cuda")
    g = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)

    def steps(model):
        outs = []
        for _ in range(6):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x)
            y.backward(g)
            outs.append([y.detach().cpu(), *(p.grad.cpu() for p in model.parameters())])
        return outs

    with pytest.warns(RuntimeWarning, match="could not be captured") as caught:
        got = steps(mlp)
    entries = [entry for chain in launches._chains.values() for entry in chain.replays.graphs.values()]
    assert all(entry is None for entry in entries)
    # one try per list (a forward's and a backward's at least), never retried
    assert sum("could not be captured" in str(w.message) for w in caught) == len(entries) >= 2
    monkeypatch.setattr(launches.config, "graphs", False)
    want = steps(twin)
    for i, (a, b) in enumerate(zip(got, want)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"call {i}"


# launch shapes that only full-size matmuls select (the tests above never reach them): the chain,
# its rows and param dtype (bfloat16: as after fuse_casts, no autocast; float32: under bf16
# autocast), and the epilogue and MatmulConfig that default_tile must pick for one of its matmuls
_FULL_SIZE = {
    "16-bit weight input grad in 128x256 TMA tiles, 4 stages":
        ([1024, 1024, 1024], 8192, torch.bfloat16, EPI_ACT_GRAD, MatmulConfig(128, 256, 64, 8, 4)),
    "float32 weight at K=256 in 128x256 pointer tiles":
        ([256, 256, 256], 32768, torch.float32, EPI_FORWARD, MatmulConfig(128, 256, 64, 8, 3, tma=False)),
    "16-bit weight input grad at K=256 in 128x128 pointer tiles":
        ([256, 256, 256], 32768, torch.bfloat16, EPI_ACT_GRAD, MatmulConfig(128, 128, 64, 8, 3, tma=False)),
    "big weight grad in groups of 16 row tiles":
        ([4096, 3072], 512, torch.float32, EPI_WGRAD, MatmulConfig(128, 256, 64, 8, 3, group_m=16)),
}


@cuda
@pytest.mark.parametrize("case", list(_FULL_SIZE))
def test_full_size_launch_shapes_match_torch(case, monkeypatch):
    sizes, rows, dtype, epi, want = _FULL_SIZE[case]
    chosen = []
    tile = tiles.default_tile

    def spy(epi_, *args):
        chosen.append((epi_, tile(epi_, *args)))
        return chosen[-1][1]

    monkeypatch.setattr(tiles, "default_tile", spy)
    monkeypatch.setattr(launches, "_plans", {})  # plans cached by another test would skip default_tile
    monkeypatch.setattr(launches, "_chains", {})
    mlp = FusedMLP(sizes, activation="relu", last_activation=True).cuda().to(dtype)
    seq = nn.Sequential(*copy.deepcopy(list(mlp.children())))
    x = torch.randn(rows, sizes[0], device="cuda", dtype=dtype)
    g = torch.randn(rows, sizes[-1], device="cuda")
    if dtype == torch.bfloat16:
        ours, same = run(mlp, x, g), run(seq, x, g)
        ref = reference(mlp, x, g)
    else:
        ours, same = run(mlp, x, g, autocast=torch.bfloat16), run(seq, x, g, autocast=torch.bfloat16)
        ref = reference(rounded(mlp, torch.bfloat16), x.bfloat16().float(), g)
    assert (epi, want) in chosen, chosen
    assert_close_to_reference(ours, same, ref, torch.bfloat16, case)


@cuda
@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "accumulate"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,width", [(2048, 4096), (8192, 1024), (65536, 256)])
def test_weight_and_bias_grad_kernel_at_full_size(rows, width, grad_dtype, accumulate):
    """The weight-grad matmul with the bias grad summed in, at the benchmark's shapes (the tests
    above never launch its 128 x 256 tiles), against float64, tightly: the tiles that also sum
    the bias once got wrong weight grads there (every run, float32 grads) while the loose
    end-to-end tolerances held. Three launches each, as a race would not show every time."""
    bf = torch.bfloat16
    g = torch.randn(rows, width, device="cuda", dtype=bf)
    x = torch.randn(rows, width, device="cuda", dtype=bf)
    want_w, want_b = g.double().t() @ x.double(), g.double().sum(0)
    tol = 1e-5 if grad_dtype == torch.float32 else 2**-8
    for _ in range(3):
        gw = torch.randn(width, width, device="cuda").to(grad_dtype) if accumulate else \
            torch.empty(width, width, device="cuda", dtype=grad_dtype)
        gb = torch.randn(width, device="cuda").to(grad_dtype) if accumulate else \
            torch.empty(width, device="cuda", dtype=grad_dtype)
        old_w, old_b = (gw.double(), gb.double()) if accumulate else (0.0, 0.0)
        launches.matmul(g.t(), x, gw, bf, EPI_WGRAD, db=gb, accumulate=accumulate)
        for name, got, want in (("weight grad", gw, want_w + old_w), ("bias grad", gb, want_b + old_b)):
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err <= tol, f"{name}: max error {err:.2e} of the largest > {tol:.1e}"


@cuda
@pytest.mark.parametrize("case", ["plain", "dropout", "weight not 16-byte aligned"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,width", [(2048, 4096), (8192, 1024), (65536, 256)])
def test_forward_and_input_grad_kernels_at_full_size(rows, width, weight_dtype, case):
    """The forward (bias + ReLU epilogue) and input-grad (ReLU grad, and the dropout scale)
    matmuls at the benchmark's shapes and default launch shapes, against float64 of the same
    rounded operands, as tightly as the bf16 output allows. Ten launches each: the input grad of
    a float32 weight read through pointers in 3-stage pipelines came out wrong in 8 launches of
    10 at 65536 x 256 and 1 of 10 at 8192 x 1024, inside the end-to-end tests' bf16 tolerances.
    A weight not 16-byte aligned cannot go through TMA: its input grad takes pointer tiles."""
    bf = torch.bfloat16
    relu = ACTIVATIONS["relu"]
    p = 0.1 if case == "dropout" else 0.0
    x = torch.randn(rows, width, device="cuda", dtype=bf)
    w = (torch.randn(width, width, device="cuda") * width**-0.5).to(weight_dtype)
    if case == "weight not 16-byte aligned":
        w = torch.empty(width * width + 1, device="cuda", dtype=weight_dtype)[1:].view(width, width).copy_(w)
    b = torch.randn(width, device="cuda")
    g = torch.randn(rows, width, device="cuda", dtype=bf)
    w64 = w.to(bf).double()  # the kernels round a float32 weight to bf16 as they read it
    want_out = torch.relu(x.double() @ w64.t() + b.double())
    saved = want_out.to(bf)  # the next layer's saved output: its ReLU (and dropout) mask
    want_dx = (g.double() @ w64) * (saved > 0) / (1.0 - p)
    for _ in range(10):
        out = torch.full((rows, width), float("nan"), device="cuda", dtype=bf)
        launches.linear_forward(x, w, b, out, None, bf, relu, 0, 0.0)
        dx = torch.full((rows, width), float("nan"), device="cuda", dtype=bf)
        launches.linear_dgrad(g, w, dx, bf, relu, saved, 7, p)
        for name, got, want in (("forward", out, want_out), ("input grad", dx, want_dx)):
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err <= 2**-8, f"{name}: max error {err:.2e} of the largest > {2**-8:.1e}"
