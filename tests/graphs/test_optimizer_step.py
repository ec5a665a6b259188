"""GraphedOptimizerStep: GradScaler's step_and_update on a graph-safe fused optimizer (or without a
scaler, its fused_step), eager until what a graph would hold is stable, then captured once and
replayed. Against the same optimizer stepping the usual way, bit for bit, over steps whose lr and
EMA weight change every time, with GradScaler's skipped steps; on a GPU a param's storage moved
mid-run drops the graph and a later call captures again. Off CUDA every call runs eagerly."""

from __future__ import annotations

import pytest
import torch

import trainfuse
from tests._helpers import set_scaled_twin_grads
from trainfuse.amp import GradScaler
from trainfuse.graphs import CapturedStep, GraphedOptimizerStep
from trainfuse.optim import FusedEMA

STEPS = 8


def _run(device, graphed: bool):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 5))
    net = net.to(device)
    opt = trainfuse.FusedAdamW(net.parameters(), lr=0.01, weight_decay=0.05, max_grad_norm=0.5)
    ema = FusedEMA(net, decay=0.9, tau=3.0)
    opt.attach_ema(ema)
    scaler = GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    return net, opt, ema, scaler, (GraphedOptimizerStep(opt, scaler) if graphed else None)


def _train(device, move_at: int | None = None):
    plain, graphed = _run(device, False), _run(device, True)
    kept = [torch.zeros_like(p) for p in graphed[0].parameters()]  # the grads stay where they are
    for it in range(STEPS):
        if it == move_at:  # a param's storage moves (in both runs): the graph must not be replayed
            for net in (plain[0], graphed[0]):
                net[0].weight.data = net[0].weight.data.clone()
        ours, theirs = list(plain[0].parameters()), list(graphed[0].parameters())
        set_scaled_twin_grads(ours, theirs, plain[3], graphed[3], it)
        for p, k in zip(graphed[0].parameters(), kept):
            p.grad = k.copy_(p.grad)
        for opt in (plain[1], graphed[1]):
            for g in opt.param_groups:
                g["lr"] = 0.002 * (1 + it)  # a warmup: the hyperparameter table changes every step
        plain[3].step_and_update(plain[1])
        graphed[4]()
        assert plain[2].updates == graphed[2].updates == it + 1
        assert plain[3].state_dict() == graphed[3].state_dict(), it
        for x, y in zip([*plain[0].parameters(), *plain[2].ema.state_dict().values()],
                        [*graphed[0].parameters(), *graphed[2].ema.state_dict().values()]):
            assert torch.equal(x, y), it
    return graphed[4]


def test_off_cuda_every_call_runs_eagerly_and_equals_the_usual_steps(kernels, device):
    if device.type == "cuda":
        pytest.skip("the CPU path; the GPU test below captures")
    phase = _train(device)
    assert (phase.eager, phase.captures, phase.replays) == (STEPS, 0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_once_replayed_and_captured_again_after_a_param_moved():
    phase = _train(torch.device("cuda"), move_at=5)
    # steps 0-1: eager (the tables built, then a steady step); 2: captured + replayed; 3-4:
    # replayed; 5: the moved param, eager (the tables rebuilt); 6: eager, steady; 7: captured again
    assert (phase.eager, phase.captures, phase.replays) == (4, 2, STEPS - 4), vars(phase)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inside_a_captured_step_equals_the_usual_steps_and_goes_when_a_param_moves():
    """The phase run inside a CapturedStep's graph after the backward (as the ultralytics trainer
    runs it): every step equal to forward, backward and step_and_update, bit for bit, with an inf
    loss skipping one step and a param moving mid-run (the step's graphs go, the phase runs on its
    own until steady, then inside again)."""
    device = torch.device("cuda")
    steps, move_at, inf_at = 14, 7, 4
    plain, graphed = _run(device, False), _run(device, True)
    net, opt, ema, scaler, phase = graphed
    grads = [torch.zeros_like(p) for p in net.parameters()]
    for p, g in zip(net.parameters(), grads):
        p.grad = g
    folding = {"now": False}

    def fn(x, y):
        torch._foreach_zero_(grads)
        scaler.scale(((net(x) - y) ** 2).mean()).backward()
        if folding["now"]:
            phase.inside()

    step = CapturedStep(fn)
    gen = torch.Generator(device).manual_seed(0)
    kinds, scales = [], []
    for it in range(steps):
        x = torch.randn(6, 9, device=device, generator=gen)
        y = torch.randn(6, 5, device=device, generator=gen)
        if it == inf_at:
            y[0, 0] = float("inf")  # inf grads: the step is skipped and the scale backs off
        if it == move_at:
            for m in (plain[0], net):
                m[0].weight.data = m[0].weight.data.clone()
            net[0].weight.grad = grads[0]
        for o in (plain[1], opt):
            for g in o.param_groups:
                g["lr"] = 0.002 * (1 + it)
        plain[1].zero_grad()
        plain[3].scale(((plain[0](x) - y) ** 2).mean()).backward()
        plain[3].step_and_update(plain[1])
        fold = phase.ready_to_fold()
        if fold and not phase.fold_holds():
            step, fold = CapturedStep(fn), False  # its graphs read what moved
        folding["now"] = fold
        if fold:
            phase.prepare()
        step(x, y, bucket=fold)
        if not fold:
            phase()
        kinds.append("in" if fold else "own")
        scales.append(scaler.get_scale())
        assert plain[2].updates == ema.updates == it + 1
        assert plain[3].state_dict() == scaler.state_dict(), it
        for a, b in zip([*plain[0].parameters(), *plain[2].ema.state_dict().values()],
                        [*net.parameters(), *ema.ema.state_dict().values()]):
            assert torch.equal(a, b), it
    # 0-1 eager, 2 its own graph; 3-6 inside; 7 the move: on its own, eager, 8 eager, 9 its own
    # graph again; 10-13 inside the new step's graphs
    assert kinds == ["own"] * 3 + ["in"] * 4 + ["own"] * 3 + ["in"] * 4, kinds
    assert (phase.eager, phase.captures, phase.folded) == (4, 2, 8), vars(phase)
    assert scales[inf_at] < scales[inf_at - 1]  # the inf step backed off


CLASSES = [(trainfuse.FusedAdamW, {"weight_decay": 0.05}), (trainfuse.FusedSGD, {"momentum": 0.9}),
           (trainfuse.FusedMuSGD, {"momentum": 0.9, "nesterov": True}),
           (trainfuse.FusedMuon, {"momentum": 0.9, "nesterov": True})]
IDS = ["adamw", "sgd", "musgd", "muon"]


def _run_unscaled(device, cls, hp, graphed: bool):
    """A net and its optimizer stepped without a GradScaler (bf16 or float32 training): Muon's
    classes on the matrices (FusedMuSGD: SGD on the rest)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 5))
    net = net.to(device)
    ps = list(net.parameters())
    matrices, rest = [p for p in ps if p.ndim >= 2], [p for p in ps if p.ndim < 2]
    groups = {trainfuse.FusedMuon: matrices,
              trainfuse.FusedMuSGD: [{"params": matrices, "use_muon": True}, {"params": rest}]}.get(cls, ps)
    opt = cls(groups, lr=0.01, max_grad_norm=0.5, **hp)
    ema = FusedEMA(net, decay=0.9, tau=3.0)
    opt.attach_ema(ema)
    return net, opt, ema, (GraphedOptimizerStep(opt, None) if graphed else None)


def _train_unscaled(device, cls, hp, move_at: int | None = None) -> GraphedOptimizerStep:
    plain, graphed = _run_unscaled(device, cls, hp, False), _run_unscaled(device, cls, hp, True)
    kept = [torch.zeros_like(p) for p in graphed[0].parameters()]  # the grads stay where they are
    gen = torch.Generator(device).manual_seed(1)
    for it in range(STEPS):
        if it == move_at:  # a param's storage moves (in both runs): the graph must not be replayed
            for net in (plain[0], graphed[0]):
                net[0].weight.data = net[0].weight.data.clone()
        for p, q, k in zip(plain[0].parameters(), graphed[0].parameters(), kept):
            p.grad = torch.randn(p.shape, device=device, generator=gen)
            q.grad = k.copy_(p.grad)
        for opt in (plain[1], graphed[1]):
            for g in opt.param_groups:
                g["lr"] = 0.002 * (1 + it)  # a warmup: the hyperparameter table changes every step
                if "momentum" in g and cls is not trainfuse.FusedSGD:
                    g["momentum"] = 0.8 + 0.01 * it  # ultralytics warms MuSGD's momentum up
        plain[1].step()
        graphed[3]()
        assert plain[2].updates == graphed[2].updates == it + 1
        for x, y in zip([*plain[0].parameters(), *plain[2].ema.state_dict().values()],
                        [*graphed[0].parameters(), *graphed[2].ema.state_dict().values()]):
            assert torch.equal(x, y), it
    return graphed[3]


@pytest.mark.parametrize("cls,hp", CLASSES, ids=IDS)
def test_without_a_scaler_off_cuda_every_call_runs_eagerly_and_equals_the_usual_steps(cls, hp, kernels,
                                                                                      device):
    if device.type == "cuda":
        pytest.skip("the CPU path; the GPU test below captures")
    phase = _train_unscaled(device, cls, hp)
    assert (phase.eager, phase.captures, phase.replays) == (STEPS, 0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls,hp", CLASSES, ids=IDS)
def test_without_a_scaler_captured_once_replayed_and_captured_again_after_a_param_moved(cls, hp):
    phase = _train_unscaled(torch.device("cuda"), cls, hp, move_at=5)
    assert (phase.eager, phase.captures, phase.replays) == (4, 2, STEPS - 4), vars(phase)


def test_fused_step_is_the_step_where_the_kernels_take_it(kernels, device):
    """fused_step: the same bits as step() where it runs (the kernels, the interpreter on CPU);
    False, nothing done, where the params have no grad or a step hook is registered (torch's step
    path runs hooks)."""
    a, b = (_run_unscaled(device, trainfuse.FusedAdamW, {}, False) for _ in range(2))
    assert not b[1].fused_step() and b[2].updates == 0  # no grad yet
    for p, q in zip(a[0].parameters(), b[0].parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    a[1].step()
    assert b[1].fused_step()
    assert a[2].updates == b[2].updates == 1  # its EMA update counted
    for x, y in zip([*a[0].parameters(), *a[2].ema.state_dict().values()],
                    [*b[0].parameters(), *b[2].ema.state_dict().values()]):
        assert torch.equal(x, y)
    handle = b[1].register_step_pre_hook(lambda *args: None)
    before = [p.clone() for p in b[0].parameters()]
    assert not b[1].fused_step() and b[2].updates == 1
    assert all(torch.equal(x, y) for x, y in zip(before, b[0].parameters()))
    handle.remove()


def test_refuses_what_it_cannot_graph(device):
    net = torch.nn.Linear(3, 2).to(device)
    fused = trainfuse.FusedAdamW(net.parameters())
    with pytest.raises(TypeError, match="fused optimizer"):
        GraphedOptimizerStep(torch.optim.AdamW(net.parameters()), GradScaler(device.type))
    with pytest.raises(TypeError, match="trainfuse.amp.GradScaler"):
        GraphedOptimizerStep(fused, torch.amp.GradScaler(device.type))
    with pytest.raises(TypeError, match="got a disabled GradScaler"):
        GraphedOptimizerStep(fused, GradScaler(device.type, enabled=False))
    assert not fused.graph_safe  # a refused phase leaves the optimizer as it was
    phase = GraphedOptimizerStep(fused, GradScaler(device.type))
    assert fused.graph_safe
    phase.close()
    assert not fused.graph_safe


def test_refuses_an_optimizer_whose_class_is_not_capturable(device):
    """A fused class that declares ``capturable = False`` (every registered one declares True):
    refused by the declaration, before anything changes."""
    eager = type("EagerSGD", (trainfuse.FusedSGD,), {"capturable": False})
    net = torch.nn.Linear(3, 2).to(device)
    opt = eager(net.parameters(), lr=0.01, momentum=0.9)
    with pytest.raises(TypeError, match=r"EagerSGD\.capturable is False"):
        GraphedOptimizerStep(opt, GradScaler(device.type))
    assert not opt.graph_safe
