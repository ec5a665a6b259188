"""trainfuse.amp.GradScaler.step_and_update against torch's GradScaler step() then update()."""

import pytest
import torch

import trainfuse
from tests._helpers import INF_STEPS, set_scaled_twin_grads
from trainfuse.amp import GradScaler
from trainfuse.optim import FusedEMA
from trainfuse.optim.direct import DirectStep

SHAPES = [(1,), (7, 13), (300,), (3, 5, 7), (130, 3)]
STEPS = 7  # with growth_interval=2 and INF_STEPS: backs off twice, grows twice


class CountingScaler(GradScaler):
    """Counts update() calls: the fused path makes none."""

    updates = 0

    def update(self, new_scale=None):
        self.updates += 1
        super().update(new_scale)


def _twins(device, cls, torch_cls, clip, **hp):
    ours = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs, cls(ours, max_grad_norm=clip, **hp), torch_cls(theirs, **hp)


def _torch_step(scaler, opt, params, clip):
    if clip is not None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, clip)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("cls,torch_cls,hp", [
    (trainfuse.FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (trainfuse.FusedAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
], ids=["sgd", "adamw"])
def test_step_and_update_matches_step_then_update(cls, torch_cls, hp, clip, kernels, device):
    """Scale, growth tracker, skipped steps and params as torch's step() then update(), over a run
    that backs off on inf and NaN and grows every two clean steps; in two launches (no update()
    call) where the kernels run."""
    ours, theirs, a, b = _twins(device, cls, torch_cls, clip, **hp)
    sa = CountingScaler(device.type, init_scale=2.0**10, growth_interval=2)
    sb = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    for it in range(STEPS):
        set_scaled_twin_grads(ours, theirs, sa, sb, it, gain=4.0)
        before = [p.detach().clone() for p in ours]
        sa.step_and_update(a)
        _torch_step(sb, b, theirs, clip)
        assert sa.get_scale() == sb.get_scale(), f"iteration {it}"
        assert sa.state_dict() == sb.state_dict(), f"iteration {it}"
        for p, q, p0 in zip(ours, theirs, before):
            if it in INF_STEPS:
                assert torch.equal(p.detach(), p0)
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)
    assert sa.updates == 0
    # and the scaler is ready for the next iteration's step() as after update()
    set_scaled_twin_grads(ours, theirs, sa, sb, STEPS, gain=4.0)
    sa.step(a)
    sa.update()


@pytest.mark.parametrize("settings", [
    dict(init_scale=2.0**127, growth_interval=1),  # growing would overflow float32: the scale stays
    dict(init_scale=2.0**10, growth_interval=1, growth_factor=4.0, backoff_factor=0.25),
], ids=["no-growth-past-float32", "interval-1-other-factors"])
def test_step_and_update_scale_arithmetic_matches_torch(settings, kernels, device):
    """The scale update in the statistics launch against torch's update(): a scale that growing
    would overflow stays where it is (the tracker resets), other factors and a growth interval of
    one; clean, inf and NaN steps."""
    ours, theirs, a, b = _twins(device, trainfuse.FusedSGD, torch.optim.SGD, None, lr=1e-3, momentum=0.9)
    sa = CountingScaler(device.type, **settings)
    sb = torch.amp.GradScaler(device.type, **settings)
    for it in range(5):
        set_scaled_twin_grads(ours, theirs, sa, sb, it, gain=1e-30)  # scaled grads stay finite
        sa.step_and_update(a)
        _torch_step(sb, b, theirs, None)
        assert sa.state_dict() == sb.state_dict(), f"iteration {it}"
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)
    assert sa.updates == 0
    if settings["init_scale"] == 2.0**127:
        assert sa.get_scale() <= 2.0**127  # it backed off on inf/NaN steps and never grew past float32


def test_step_and_update_counts_the_ema_once_per_step_as_ultralytics(kernels, device):
    """An attached FusedEMA moves once per step_and_update, skipped steps included, as after
    step() then update()."""
    def net():
        return torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 5))

    model, twin = net().to(device), net().to(device)
    twin.load_state_dict(model.state_dict())
    runs = []
    for net in (model, twin):
        opt = trainfuse.FusedSGD(net.parameters(), lr=0.1, momentum=0.9, max_grad_norm=10.0)
        ema = FusedEMA(net)
        opt.attach_ema(ema)
        runs.append((net, opt, ema, GradScaler(device.type, init_scale=2.0**8, growth_interval=2)))
    for it in range(5):
        (na, oa, ea, sa), (nb, ob, eb, sb) = runs
        set_scaled_twin_grads(list(na.parameters()), list(nb.parameters()), sa, sb, it)
        sa.step_and_update(oa)
        sb.step(ob)
        sb.update()
        assert ea.updates == eb.updates == it + 1
        assert sa.state_dict() == sb.state_dict()
        for x, y in zip([*na.parameters(), *ea.ema.state_dict().values()],
                        [*nb.parameters(), *eb.ema.state_dict().values()]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["unscaled by hand", "growth 1.1", "another optimizer", "hook"])
def test_step_and_update_falls_back_to_step_then_update(case, kernels, device):
    """Where the two-launch path does not apply, step() then update() run (and give torch's
    results): grads unscaled by hand, a growth factor torch multiplies in float64, another
    optimizer stepped since the last update, a step hook."""
    ours, theirs, a, b = _twins(device, trainfuse.FusedSGD, torch.optim.SGD, None, lr=0.1, momentum=0.9)
    growth = 1.1 if case == "growth 1.1" else 2.0
    sa = CountingScaler(device.type, init_scale=2.0**10, growth_interval=1, growth_factor=growth)
    sb = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=1, growth_factor=growth)
    other = trainfuse.FusedSGD([torch.nn.Parameter(torch.zeros(3, device=device))], lr=0.1)
    seen = []
    if case == "hook":
        a.register_step_pre_hook(lambda *args: seen.append(1))
    for it in range(3):
        set_scaled_twin_grads(ours, theirs, sa, sb, it)
        if case == "unscaled by hand":
            sa.unscale_(a)
        if case == "another optimizer":
            other.param_groups[0]["params"][0].grad = torch.ones(3, device=device) * sa.get_scale()
            sa.step(other)
        sa.step_and_update(a)
        _torch_step(sb, b, theirs, None)
        assert sa.get_scale() == sb.get_scale()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)
    assert sa.updates == 3
    assert len(seen) == (3 if case == "hook" else 0)


def test_a_bad_lr_raises_before_the_scale_moves(kernels, device):
    """step_and_update validates the hyperparameters before it launches: a negative lr raises
    and leaves scale, tracker and params as they were."""
    ps = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    opt = trainfuse.FusedSGD(ps, lr=0.1, momentum=0.9)
    scaler = GradScaler(device.type, init_scale=2.0**10, growth_interval=1)
    for p in ps:
        p.grad = torch.randn_like(p) * scaler.scale(torch.ones((), device=device))
    scaler.step_and_update(opt)  # tables built
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.param_groups[0]["lr"] = -1.0
    state, before = scaler.state_dict(), [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match="learning rate"):
        scaler.step_and_update(opt)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert scaler.state_dict() == state
    assert all(torch.equal(p.detach(), p0) for p, p0 in zip(ps, before))


def test_step_and_update_follows_what_changes_between_steps(kernels, device, monkeypatch):
    """Steps after the first launch again with the arguments they resolved (``DirectStep``, on a
    GPU): an lr and momentum change, clipping switched on and its bound moved, a new growth
    interval and grads at an address that is not 16-byte aligned must each reach the kernels.
    Against torch's step() then update(), with the same changes."""
    launches = []
    launch = DirectStep.launch
    monkeypatch.setattr(DirectStep, "launch", lambda self, ema_w: launches.append(1) or launch(self, ema_w))
    ours, theirs, a, b = _twins(device, trainfuse.FusedSGD, torch.optim.SGD, None, lr=0.1, momentum=0.9)
    sa = CountingScaler(device.type, init_scale=2.0**10, growth_interval=2)
    sb = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    clip = None
    for it in range(12):
        if it == 4:
            for opt in (a, b):
                opt.param_groups[0].update(lr=0.03, momentum=0.5)
        if it == 6:
            a.max_grad_norm = clip = 0.5
        if it == 8:
            a.max_grad_norm = clip = 2.0
            sa.set_growth_interval(1)
            sb.set_growth_interval(1)
        set_scaled_twin_grads(ours, theirs, sa, sb, it, gain=4.0)
        if it >= 10:  # the same values, 4 bytes past an aligned address
            for p in ours:
                buf = torch.empty(p.numel() + 1, device=device)
                buf[1:].copy_(p.grad.flatten())
                p.grad = buf[1:].view_as(p)
        sa.step_and_update(a)
        _torch_step(sb, b, theirs, clip)
        assert sa.state_dict() == sb.state_dict(), f"iteration {it}"
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, it=it: f"iteration {it}: {m}")
    assert sa.updates == 0
    assert (len(launches) >= 6) == (device.type == "cuda"), launches


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("muon", [False, True], ids=["musgd", "muon"])
def test_newton_schulz_steps_and_updates_in_two_launches(muon, clip, nesterov, kernels, device):
    """FusedMuSGD with Muon groups, and FusedMuon: step_and_update runs the statistics pass, the
    Newton-Schulz part on the grads divided by the scale that pass read (and clipped), then the
    update; the same bits as torch's GradScaler step() then update() stepping the same optimizer,
    skipped steps included."""
    shapes = [(6, 5), (4, 3, 3, 3), (7, 4), (9,), (3,)]  # Muon matrices (the third takes the inf), vectors
    if muon:
        shapes = [(6, 5), (3, 8), (7, 4)]

    def make():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        if muon:
            return ps, trainfuse.FusedMuon(ps, lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=1e-3,
                                           max_grad_norm=clip)
        groups = [{"params": ps[:3], "use_muon": True}, {"params": ps[3:]}]
        return ps, trainfuse.FusedMuSGD(groups, lr=0.02, momentum=0.9, nesterov=nesterov,
                                        weight_decay=1e-3, max_grad_norm=clip)

    ours, a = make()
    theirs, b = make()
    sa = CountingScaler(device.type, init_scale=2.0**10, growth_interval=2)
    sb = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    for it in range(STEPS):
        set_scaled_twin_grads(ours, theirs, sa, sb, it, gain=4.0)
        before = [p.detach().clone() for p in ours]
        sa.step_and_update(a)
        sb.step(b)
        sb.update()
        assert sa.get_scale() == sb.get_scale() and sa.state_dict() == sb.state_dict(), f"iteration {it}"
        for k, (p, q, p0) in enumerate(zip(ours, theirs, before)):
            if it in INF_STEPS:
                assert torch.equal(p.detach(), p0)
            assert torch.equal(p.detach(), q.detach()), f"iteration {it} param {k}"
    assert sa.updates == 0  # every step in the two launches
