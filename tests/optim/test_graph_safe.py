"""Graph-safe steps (``set_graph_safe(True)``, ``prepare_step()``): the host part of a step (the
EMA's update count and weight, the groups' hyperparameters) goes to device memory before the
launches, which then read it there. Against the same optimizer stepping the usual way, over steps
whose lr and EMA weight change every time, with GradScaler's skipped steps: equal bit for bit,
eagerly (the kernels through the interpreter on CPU) and, on a GPU, with the step captured once in
a CUDA graph and replayed. Whether a class's steps may be made graph-safe is its own declaration,
``capturable``."""

from __future__ import annotations

import pytest
import torch

import trainfuse
from tests._helpers import INF_STEPS, set_scaled_twin_grads
from trainfuse.amp import GradScaler
from trainfuse.optim import FusedEMA, FusedOptimizer, registry
from trainfuse.optim.plans import CaptureView

STEPS = 7
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _net(device) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 5))
    return net.to(device)


def _groups(cls, net):
    """FusedMuSGD: Muon on the matrices, SGD on the rest; FusedMuon: the matrices (the rest left
    alone); any other class: one group."""
    ps = list(net.parameters())
    if cls is trainfuse.FusedMuon:
        return [p for p in ps if p.ndim >= 2]
    if cls is not trainfuse.FusedMuSGD:
        return ps
    return [{"params": [p for p in ps if p.ndim >= 2], "use_muon": True},
            {"params": [p for p in ps if p.ndim < 2]}]


def _run(device, cls, hp, graph_safe: bool):
    net = _net(device)
    opt = cls(_groups(cls, net), max_grad_norm=0.5, **hp)
    ema = FusedEMA(net, decay=0.9, tau=3.0)  # a ramp: the weight changes every update
    opt.attach_ema(ema)
    opt.set_graph_safe(graph_safe)
    return net, opt, ema, GradScaler(device.type, init_scale=2.0**10, growth_interval=2)


def _lr(it: int) -> float:
    return 0.02 * (1 + it) / STEPS  # a warmup: the table is rewritten every step


def _schedule(opt, it: int) -> None:
    """This step's lr (and MuSGD's momentum, which ultralytics warms up too)."""
    for g in opt.param_groups:
        g["lr"] = _lr(it)
        if "use_muon" in g or "ns_steps" in g:  # MuSGD's, Muon's
            g["momentum"] = 0.8 + 0.1 * it / STEPS


@pytest.mark.parametrize("cls,hp", [(trainfuse.FusedAdamW, {"weight_decay": 0.05}),
                                    (trainfuse.FusedSGD, {"momentum": 0.9, "nesterov": True}),
                                    (trainfuse.FusedMuSGD, {"momentum": 0.9, "nesterov": True}),
                                    (trainfuse.FusedMuon, {"momentum": 0.9, "nesterov": True})],
                         ids=["adamw", "sgd", "musgd", "muon"])
def test_prepared_steps_equal_the_usual_ones(cls, hp, kernels, device):
    plain, safe = _run(device, cls, hp, False), _run(device, cls, hp, True)
    for it in range(STEPS):
        set_scaled_twin_grads(list(plain[0].parameters()), list(safe[0].parameters()), plain[3], safe[3], it)
        for opt in (plain[1], safe[1]):
            _schedule(opt, it)
        plain[3].step_and_update(plain[1])
        safe[1].prepare_step()
        safe[3].step_and_update(safe[1])
        assert plain[2].updates == safe[2].updates == it + 1
        assert plain[3].state_dict() == safe[3].state_dict(), it
        for x, y in zip([*plain[0].parameters(), *plain[2].ema.state_dict().values()],
                        [*safe[0].parameters(), *safe[2].ema.state_dict().values()]):
            assert torch.equal(x, y), it
    assert set(INF_STEPS) < set(range(STEPS))  # skipped steps were among them


def test_prepare_step_needs_graph_safe(device):
    opt = trainfuse.FusedAdamW(_net(device).parameters())
    with pytest.raises(RuntimeError, match=r"set_graph_safe\(True\)"):
        opt.prepare_step()


# each registered fused class and whether its step replays from a CUDA graph
CAPTURABLE = {"FusedAdamW": True, "FusedAdam": True, "FusedSGD": True, "FusedMuSGD": True,
              "FusedMuon": True}


def test_every_registered_class_declares_whether_its_step_is_capturable():
    classes = registry.fused_classes()
    assert set(classes) == set(CAPTURABLE)  # a new registry line declares it here too
    for name, cls in classes.items():
        # declared by the class or a fused ancestor of its own, not inherited from the base's False
        assert any("capturable" in vars(c) for c in cls.__mro__
                   if issubclass(c, FusedOptimizer) and c is not FusedOptimizer), name
        assert cls.capturable is CAPTURABLE[name], name
    assert FusedOptimizer.capturable is False  # a new subclass is not graph-safe until it says so


@pytest.mark.parametrize("name", [n for n, on in CAPTURABLE.items() if on])
def test_set_graph_safe_round_trips(name, device):
    cls = registry.fused_classes()[name]
    opt = cls(_groups(cls, _net(device)), lr=0.01)
    assert opt.graph_safe is False
    opt.set_graph_safe(True)
    assert opt.graph_safe is True
    opt.prepare_step()  # allowed now
    opt.set_graph_safe(False)
    assert opt.graph_safe is False
    with pytest.raises(RuntimeError, match="set_graph_safe"):
        opt.prepare_step()
    with pytest.raises(AttributeError):
        opt.graph_safe = True  # the optimizer's own setting: set_graph_safe changes it


class _Eager(trainfuse.FusedSGD):
    """A fused class that declares its steps not capturable (every registered one is)."""

    capturable = False


def test_a_class_that_is_not_capturable_refuses_graph_safe_steps(device):
    weight = torch.nn.Parameter(torch.randn(4, 3, device=device))
    opt = _Eager([weight], lr=0.01, momentum=0.9)
    with pytest.raises(TypeError, match=r"_Eager\.set_graph_safe: .*_Eager\.capturable is False"):
        opt.set_graph_safe(True)
    assert opt.graph_safe is False
    opt.set_graph_safe(False)  # turning it off is always allowed
    assert opt.graph_safe is False


def test_the_torch_capturable_keyword_stays_a_group_key(device):
    """FusedAdam's ``capturable=`` is torch's per-group option, kept for the state_dict layout; the
    class attribute says what the class can do, whatever the groups say."""
    net = _net(device)
    opt = trainfuse.FusedAdamW(net.parameters(), capturable=False)
    assert opt.capturable is True and type(opt).capturable is True
    assert all(g["capturable"] is False for g in opt.param_groups)
    assert all(g["capturable"] is False for g in opt.state_dict()["param_groups"])
    stock = torch.optim.AdamW(net.parameters(), capturable=False)
    assert opt.state_dict()["param_groups"][0].keys() == stock.state_dict()["param_groups"][0].keys()
    opt.set_graph_safe(True)  # the class's declaration decides, not the groups' key
    assert opt.graph_safe


def test_the_capture_view_names_the_tables_generation_device_and_params(kernels, device):
    net = _net(device)
    opt = trainfuse.FusedSGD(net.parameters(), lr=0.01)
    before = opt.capture_view()
    assert isinstance(before, CaptureView) and before.device is None and len(before.params) == 0
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    view = opt.capture_view()
    assert view.generation == opt.engine.plans.generation != before.generation
    assert view.device == next(net.parameters()).device
    assert [id(p) for p in view.params] == [id(p) for p in net.parameters()]
    opt.step()
    again = opt.capture_view()  # the same tables
    assert again.generation == view.generation and again.device == view.device
    assert again.params is view.params
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device), requires_grad=True)]})
    opt.param_groups[-1]["params"][0].grad = torch.ones(3, device=device)
    opt.step()
    grown = opt.capture_view()
    assert grown.generation != view.generation and len(grown.params) == len(view.params) + 1


def test_the_generation_changes_with_the_tables(kernels, device):
    net = _net(device)
    opt = trainfuse.FusedAdamW(net.parameters())
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    first = opt.engine.plans.generation
    opt.step()
    assert opt.engine.plans.generation == first  # the same tables
    opt.state.clear()
    opt.step()
    assert opt.engine.plans.generation != first  # dropped and built anew
    second = opt.engine.plans.generation
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device))]})
    opt.step()
    assert opt.engine.plans.generation not in (first, second)


@cuda
@pytest.mark.parametrize("cls,hp", [(trainfuse.FusedAdamW, {"weight_decay": 0.05}),
                                    (trainfuse.FusedSGD, {"momentum": 0.9, "nesterov": True}),
                                    (trainfuse.FusedMuSGD, {"momentum": 0.9, "nesterov": True}),
                                    (trainfuse.FusedMuon, {"momentum": 0.9, "nesterov": True})],
                         ids=["adamw", "sgd", "musgd", "muon"])
def test_a_captured_step_replays_as_the_next_steps(cls, hp):
    """One step_and_update captured in a CUDA graph (the grads kept where they are, the lr and
    the EMA weight written by prepare_step before each replay) against the usual eager steps."""
    device = torch.device("cuda")
    plain, safe = _run(device, cls, hp, False), _run(device, cls, hp, True)
    kept = [torch.zeros_like(p) for p in safe[0].parameters()]  # the graph reads the grads there
    graph, generation = None, None
    for it in range(STEPS):
        set_scaled_twin_grads(list(plain[0].parameters()), list(safe[0].parameters()), plain[3], safe[3], it)
        for p, k in zip(safe[0].parameters(), kept):
            p.grad = k.copy_(p.grad)
        for opt in (plain[1], safe[1]):
            _schedule(opt, it)
        plain[3].step_and_update(plain[1])
        safe[1].prepare_step()
        if it < 2:  # eager: the tables are built, the kernels compiled
            safe[3].step_and_update(safe[1])
        elif graph is None:  # the capture records this step's launches; the replay makes it
            generation = safe[1].engine.plans.generation
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                safe[3].step_and_update(safe[1])
            torch.cuda.current_stream().wait_stream(side)
            graph.replay()
        else:
            graph.replay()
        if graph is not None:
            assert safe[1].engine.plans.generation == generation  # the tables the graph holds
        torch.cuda.synchronize()
        assert plain[3].state_dict() == safe[3].state_dict(), it
        for x, y in zip([*plain[0].parameters(), *plain[2].ema.state_dict().values()],
                        [*safe[0].parameters(), *safe[2].ema.state_dict().values()]):
            assert torch.equal(x, y), it
