"""The step driver's contract with the optimizer is code: every fused optimizer is an
``OptimizerClient``, the driver reads an optimizer through that protocol's members and nothing
else, and one plan cache decides for every entry point whether a cached plan still holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import trainfuse
import trainfuse.optim
from trainfuse.optim import FusedOptimizer
from trainfuse.optim.contract import OptimizerClient

OPTIM = Path(trainfuse.optim.__file__).parent
# the step driver and the collaborators it hands the client to
DRIVER_MODULES = ["engine", "plans", "index", "build", "torch_path", "hparams", "direct", "sharded",
                  "tracked"]
MEMBERS = set(OptimizerClient.__annotations__) | {
    name for name, value in vars(OptimizerClient).items() if callable(value) and not name.startswith("_")}


def _fused_classes() -> list[type]:
    """trainfuse's subclasses of FusedOptimizer; not the wrappers Lightning makes at run time
    (``LightningFusedAdamW``, whose ``__init__`` takes an optimizer), which an earlier test of
    the same process leaves behind."""
    found, todo = [], [FusedOptimizer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("trainfuse."):
                found.append(sub)
            todo.append(sub)
    return found


def _client_reads(path: Path) -> set[str]:
    """Attributes read on ``client``, ``self.client`` or (tracked's functions) ``optimizer``."""
    reads = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("client", "optimizer"):
                reads.add(node.attr)
            elif (isinstance(base, ast.Attribute) and base.attr == "client"
                  and isinstance(base.value, ast.Name) and base.value.id == "self"):
                reads.add(node.attr)
    return reads


def test_every_fused_optimizer_is_an_engine_client():
    """The registry's fused classes and every other subclass of FusedOptimizer."""
    registered = set(trainfuse.optim.registry.fused_classes().values())
    classes = set(_fused_classes()) | registered
    assert {trainfuse.FusedAdam, trainfuse.FusedAdamW, trainfuse.FusedSGD} <= registered
    for cls in sorted(classes, key=lambda c: c.__name__):
        opt = cls([torch.nn.Parameter(torch.randn(3, 2))])  # a matrix: FusedMuon takes nothing else
        assert isinstance(opt, OptimizerClient), cls.__name__
        assert opt.engine.client is opt


def test_an_optimizer_missing_a_member_is_not_a_client():
    opt = trainfuse.FusedSGD([torch.nn.Parameter(torch.randn(3))])
    assert isinstance(opt, OptimizerClient)
    assert not isinstance(torch.optim.SGD([torch.nn.Parameter(torch.randn(3))]), OptimizerClient)


def test_the_driver_reads_the_client_through_the_protocol_only():
    """Every member the driver and its collaborators read on the optimizer is in the protocol,
    and every member of the protocol is read: a reader and a type checker see the same list."""
    reads = set()
    for name in DRIVER_MODULES:
        reads |= _client_reads(OPTIM / f"{name}.py")
    assert reads - MEMBERS == set(), "read on the client but not in OptimizerClient"
    assert MEMBERS - reads == set(), "in OptimizerClient but read nowhere"


PACKAGE_FILES = sorted(p.relative_to(OPTIM.parent).as_posix() for d in ("optim", "amp", "_multi_tensor")
                       for p in (OPTIM.parent / d).glob("*.py"))


@pytest.mark.parametrize("path", PACKAGE_FILES)
def test_no_private_member_of_another_object_is_read(path):
    """Within the optimizers, AMP and the tables too, a private attribute is read on ``self``,
    ``cls`` or a class of the same file only; torch's ``_foreach_*`` ops are public API in all but
    name."""
    tree = ast.parse((OPTIM.parent / path).read_text())
    own = {"self", "cls"} | {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in own:
                continue
            if node.attr.startswith("_foreach_") or isinstance(node.ctx, ast.Store):
                continue
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def _scaled_step(opt, device):
    scale = torch.full((1,), 4.0, device=device)
    tracker = torch.zeros(1, dtype=torch.int32, device=device)
    for p in opt.param_groups[0]["params"]:
        p.grad.mul_(4.0)
    assert opt.scaled_step(scale, (tracker, 2.0, 0.5, 1000))


def _check_then_step(opt, device):
    found = opt.check_grads(torch.ones(1, device=device))
    assert list(found) == [opt.param_groups[0]["params"][0].device]
    opt.step()


ENTRY_POINTS = {"step": lambda opt, device: opt.step(), "check_grads": _check_then_step,
                "scaled_step": _scaled_step}


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_every_entry_point_reuses_a_plan_that_holds_and_rebuilds_one_that_does_not(entry_point, kernels,
                                                                                     device):
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in [(40,), (3, 7), (5,)]]
    opt = trainfuse.FusedSGD(params, lr=0.1, momentum=0.9, max_grad_norm=100.0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    entry = opt.engine.plans.get(params[0].device)
    for p in params:
        p.grad = torch.randn_like(p)
    ENTRY_POINTS[entry_point](opt, device)
    assert opt.engine.plans.get(params[0].device) is entry  # params where they were, grads patched in
    assert entry.grad_addresses == [p.grad.data_ptr() for p in params]
    params[1].data = params[1].data.clone()  # a moved param storage: the plan no longer holds
    for p in params:
        p.grad = torch.randn_like(p)
    ENTRY_POINTS[entry_point](opt, device)
    rebuilt = opt.engine.plans.get(params[0].device)
    assert rebuilt is not entry and rebuilt.param_and_ema_addresses[1] == params[1].data_ptr()


def test_a_changed_state_drops_the_plans_before_any_entry_point_looks(kernels, device):
    params = [torch.nn.Parameter(torch.randn(6, device=device))]
    opt = trainfuse.FusedAdamW(params, lr=0.1)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    entry = opt.engine.plans.get(params[0].device)
    # a replaced state tensor: every address the plan compares is where it was
    opt.state[params[0]]["exp_avg"] = torch.zeros_like(params[0])
    assert opt.check_grads(torch.ones(1, device=device)) is not None
    assert opt.engine.plans.get(params[0].device) is not entry
