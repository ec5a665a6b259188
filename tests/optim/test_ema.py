"""FusedEMA against torch._foreach_lerp_ and ultralytics' ModelEMA, standalone and attached to a
fused optimizer (kernels through the interpreter on CPU)."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

import trainfuse
from trainfuse import FusedEMA
from trainfuse._runtime.launch import DirectLaunch


def _model(device, dtype=torch.float32):
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 36, 7))
    return m.to(device=device, dtype=dtype)


def _perturb(model):
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.dtype.is_floating_point:
                t.add_(torch.randn_like(t))


def _reference(ema_sd, model_sd, w):
    """ModelEMA's update: _foreach_lerp_ over the floating-point entries, in float64 here."""
    return {k: torch.lerp(v.double(), model_sd[k].double(), w) if v.dtype.is_floating_point else v
            for k, v in ema_sd.items()}


@pytest.mark.parametrize("updates", [0, 3000], ids=["ramp-start", "weight-below-half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_update_matches_foreach_lerp(updates, dtype, kernels, device):
    model = _model(device, dtype)
    ema = FusedEMA(model, updates=updates)
    for k in range(3):
        _perturb(model)
        expected = _reference(ema.ema.state_dict(), model.state_dict(), 1 - ema.decay(updates + k + 1))
        ema.update(model)
        assert ema.updates == updates + k + 1
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
        for name, v in ema.ema.state_dict().items():
            if v.dtype.is_floating_point:
                torch.testing.assert_close(v.double(), expected[name].to(dtype).double(), **tol, msg=name)
            else:
                assert torch.equal(v, expected[name])  # num_batches_tracked is not averaged


def test_float32_ema_of_a_bfloat16_model(kernels, device):
    model = _model(device)
    ema = FusedEMA(model)
    model.to(torch.bfloat16)  # the EMA stays float32, as after trainfuse.amp.fuse_casts
    _perturb(model)
    expected = _reference(ema.ema.state_dict(), model.state_dict(), 1 - ema.decay(1))
    ema.update(model)
    for name, v in ema.ema.state_dict().items():
        assert v.dtype == (torch.float32 if v.dtype.is_floating_point else torch.int64)
        if v.dtype.is_floating_point:
            torch.testing.assert_close(v.double(), expected[name], rtol=1e-6, atol=1e-6)


def test_decay_ramp_attributes_and_update_attr(device):
    model = _model(device)
    ema = FusedEMA(model, decay=0.99, tau=10, updates=5)
    model.names = {0: "a"}
    model._private = 1
    assert ema.updates == 5 and ema.enabled
    assert math.isclose(ema.decay(20), 0.99 * (1 - math.exp(-2.0)))
    assert all(not p.requires_grad for p in ema.ema.parameters()) and not ema.ema.training
    ema.update_attr(model, include=["names"])
    assert ema.ema.names == {0: "a"} and not hasattr(ema.ema, "_private")
    ema.enabled = False
    ema.update(model)
    assert ema.updates == 5


def _ultralytics_model():
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/trainfuse-yolo-config")
    pytest.importorskip("ultralytics")
    from ultralytics.nn.tasks import DetectionModel
    from ultralytics.utils.torch_utils import ModelEMA

    return DetectionModel("yolov5n.yaml", verbose=False), ModelEMA


def test_matches_ultralytics_model_ema_on_yolov5n(kernels, device, monkeypatch):
    model, ModelEMA = _ultralytics_model()
    model.to(device)
    from trainfuse._multi_tensor.tables import config

    # 2.6M params: few programs of one large block each (the interpreter's cost is per operation)
    monkeypatch.setattr(config, "block", 16384)
    monkeypatch.setattr(config, "unroll", 1)
    start = 2990
    theirs, ours = ModelEMA(model, updates=start), FusedEMA(model, updates=start)
    floating = [k for k, v in model.state_dict().items() if v.dtype.is_floating_point]
    assert len(ours.tensors()) == 2 * len(floating)  # every floating param and buffer, paired
    for _ in range(3):  # updates 2991..2993: weights on both sides of 0.5 come from the ramp below
        _perturb(model)
        theirs.update(model)
        ours.update(model)
    assert theirs.updates == ours.updates
    for (k, a), b in zip(theirs.ema.state_dict().items(), ours.ema.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("cls,hp", [(trainfuse.FusedSGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
                                    (trainfuse.FusedAdamW, dict(lr=1e-2))], ids=["sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attached_ema_equals_step_then_update(cls, hp, dtype, kernels, device, monkeypatch):
    """Folded into the update (a bfloat16 model: EMA in the param's dtype, lerp toward the stored
    bfloat16 weight) the EMA is what a step followed by FusedEMA.update gives."""
    # the two twins' conv weight grads must be equal bit for bit: cuDNN's default backward
    # algorithms may add in a different order run to run (a bfloat16 ulp apart after the step)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = _model(device, dtype)
    twin = copy.deepcopy(model)
    ours = cls(model.parameters(), **hp)
    theirs = cls(twin.parameters(), **hp)
    start = 2990
    ema_a, ema_b = FusedEMA(model, updates=start), FusedEMA(twin, updates=start)
    ours.attach_ema(ema_a)
    x = torch.randn(4, 3, 8, 8, device=device, dtype=dtype)
    for _ in range(3):
        for m, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            m(x).square().mean().backward()  # train mode: BatchNorm running stats move too
        model[4].bias.grad = None  # a param without a grad this step: the EMA still follows it
        twin[4].bias.grad = None
        ours.step()
        ema_a.update(model)  # attached: the step did it, this is a no-op
        theirs.step()
        ema_b.update(twin)
    assert ema_a.updates == ema_b.updates == start + 3
    for (k, a), b in zip(ema_a.ema.state_dict().items(), ema_b.ema.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=k)


def test_attached_ema_moves_on_a_skipped_step(kernels, device):
    model = _model(device)
    opt = trainfuse.FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = FusedEMA(model, updates=100)
    opt.attach_ema(ema)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    expected = _reference(ema.ema.state_dict(), model.state_dict(), 1 - ema.decay(101))
    opt.found_inf = torch.ones((), device=device)
    opt.step()
    del opt.found_inf
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    for k, v in ema.ema.state_dict().items():
        if v.dtype.is_floating_point:
            torch.testing.assert_close(v.double(), expected[k], rtol=1e-6, atol=1e-6, msg=k)


def test_attach_ema_with_masters_follows_the_float32_master(kernels, device):
    model = nn.Sequential(nn.Linear(6, 30), nn.Linear(30, 3)).to(device)
    opt = trainfuse.FusedAdamW(model.parameters(), lr=1e-2)
    ema = FusedEMA(model, updates=50)
    trainfuse.amp.fuse_casts(model, opt)
    opt.attach_ema(ema)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    prev = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    opt.step()
    w = 1 - ema.decay(51)
    for (k, e), p in zip(ema.ema.state_dict().items(), model.parameters()):
        assert e.dtype == torch.float32
        expected = torch.lerp(prev[k].double(), opt.state[p]["master_param"].double(), w)
        torch.testing.assert_close(e.double(), expected, rtol=1e-6, atol=1e-6)


def test_attached_ema_and_clipping_with_no_gradient_at_all(kernels, device):
    """A step where no param has a grad: the EMA rows alone run, the norm is 0."""
    model = _model(device)
    opt = trainfuse.FusedSGD(model.parameters(), lr=0.1, max_grad_norm=1.0)
    ema = FusedEMA(model, updates=100)
    opt.attach_ema(ema)
    _perturb(model)
    expected = _reference(ema.ema.state_dict(), model.state_dict(), 1 - ema.decay(101))
    opt.step()
    assert float(opt.grad_norm) == 0.0
    for k, v in ema.ema.state_dict().items():
        if v.dtype.is_floating_point:
            torch.testing.assert_close(v.double(), expected[k], rtol=1e-6, atol=1e-6, msg=k)


def test_attached_ema_follows_tensors_whose_storage_moved(kernels, device):
    """The cached tables hold addresses: an EMA tensor or a model buffer given new storage in
    place (``.data =``, what ``Module.to`` does) between steps must be read and written at its
    new address, and the old storage left alone."""
    model = _model(device)
    opt = trainfuse.FusedSGD(model.parameters(), lr=0.1)
    ema = FusedEMA(model, updates=100)
    opt.attach_ema(ema)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # tables built and cached
    old_ema_w = ema.ema[0].weight.data
    ema.ema[0].weight.data = old_ema_w.clone()  # the EMA tensor moves
    stale = old_ema_w.clone()
    model[1].running_mean.data = model[1].running_mean.data.clone() + 1.0  # a source buffer moves
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    ema_before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    w = 1 - ema.decay(102)
    opt.step()
    expected = _reference(ema_before, model.state_dict(), w)  # params after the step, as ModelEMA
    for k, v in ema.ema.state_dict().items():
        if v.dtype.is_floating_point:
            torch.testing.assert_close(v.double(), expected[k], rtol=1e-6, atol=1e-6, msg=k)
    assert torch.equal(old_ema_w, stale)  # nothing was written to the old storage


def test_standalone_ema_follows_tensors_whose_storage_moved(kernels, device, monkeypatch):
    """FusedEMA.update repeats its last launch while every address is where it was (on a GPU,
    with its arguments resolved): an EMA tensor or a model buffer given new storage must be read
    and written at the new address, with the ramp's new weight, and the old storage left alone."""
    launches = []
    direct = DirectLaunch.__call__
    monkeypatch.setattr(DirectLaunch, "__call__", lambda self, *a: launches.append(1) or direct(self, *a))
    model = _model(device)
    ema = FusedEMA(model, updates=100)
    for _ in range(3):  # the last two repeat the first's launch
        _perturb(model)
        ema.update(model)
    old_ema_w = ema.ema[0].weight.data
    ema.ema[0].weight.data = old_ema_w.clone()
    stale = old_ema_w.clone()
    model[1].running_var.data = model[1].running_var.data.clone() + 1.0
    for _ in range(2):
        _perturb(model)
        expected = _reference(ema.ema.state_dict(), model.state_dict(), 1 - ema.decay(ema.updates + 1))
        ema.update(model)
        for k, v in ema.ema.state_dict().items():
            if v.dtype.is_floating_point:
                torch.testing.assert_close(v.double(), expected[k], rtol=1e-6, atol=1e-6, msg=k)
    assert torch.equal(old_ema_w, stale)
    # on a GPU the repeats went through the direct launch: the 2 after the first, and the second
    # update after each move (its first re-plans)
    assert (len(launches) >= 3) == (device.type == "cuda"), launches
