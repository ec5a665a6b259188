"""FusedMuSGD against ultralytics' MuSGD: the torch path bit for bit, the kernels (the interpreter on
CPU) one step at a time within float32 tolerance, the state_dict both ways, and its errors."""

from __future__ import annotations

import copy

import pytest
import torch

from trainfuse.optim.musgd import FusedMuSGD

MuSGD = pytest.importorskip("ultralytics.optim").MuSGD

# the kernel tests run where the kernels do: CUDA on a GPU machine, the interpreter on CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU = torch.device("cpu")
# The kernels' float32 math against MuSGD's torch ops, from the same states.
KERNEL_TOL = dict(rtol=1e-5, atol=1e-6)
# The padded Newton-Schulz batches sum in another order than MuSGD's per-matrix products (cuBLAS on
# a GPU; on the CPU too for some inputs: a conv weight 9.8e-6 off after one step, one seed in many;
# and with clipping by norm the clip coefficient's last bits differ), and the quintic iteration
# amplifies that bfloat16 rounding
# along small singular directions (slope 3.4445 at zero, five times): an element of the
# orthogonalized update may move by a few percent (2% measured on an H200), a Muon weight by that
# times lr * muon * its scale, and its SGD buffer by weight_decay times that.
# test_batched_newton_schulz_pads_as_its_layout_says checks the padding exactly, on any device.
MUON_SCALES = {"conv.weight": 1.0, "pw.weight": 1.0, "fc.weight": 1.0, "tall.weight": (40 / 6) ** 0.5}
GPU_MUON_STEP = 0.1


def _tol(name: str, hp: dict, key: str | None = None) -> dict:
    """The tolerance of weight ``name`` (or of its state ``key``) after a step with ``hp``: a Muon
    weight's Newton-Schulz may round some bfloat16 products unlike MuSGD's, on any device."""
    if name not in MUON_SCALES:
        return KERNEL_TOL
    step = GPU_MUON_STEP * hp["lr"] * hp.get("muon", 0.5) * MUON_SCALES[name]
    if key == "momentum_buffer":  # the Muon momentum: the grads only
        return KERNEL_TOL
    if key == "momentum_buffer_SGD":
        step *= hp.get("weight_decay", 0.0)
    return dict(rtol=KERNEL_TOL["rtol"], atol=KERNEL_TOL["atol"] + step)


class _Net(torch.nn.Module):
    """Convs (one channels_last), BatchNorm, a wide linear and a tall one, a head with its own lr."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.pw = torch.nn.Conv2d(8, 12, 1).to(memory_format=torch.channels_last)
        self.fc = torch.nn.Linear(12 * 16, 6)
        self.tall = torch.nn.Linear(6, 40)
        self.head = torch.nn.Linear(40, 3)

    def forward(self, x):
        x = self.pw(torch.relu(self.bn(self.conv(x))))
        return self.head(torch.tanh(self.tall(self.fc(x.flatten(1)))))


def _groups(net: _Net) -> list[dict]:
    """ultralytics' layout: Muon on the weights, SGD on biases and norms, the head at 3x lr."""
    head = list(net.head.parameters())
    weights = [p for n, p in net.named_parameters() if p.ndim >= 2 and not n.startswith("head")]
    others = [p for n, p in net.named_parameters() if p.ndim < 2 and not n.startswith("head")]
    return [{"params": weights, "use_muon": True}, {"params": others, "use_muon": False},
            {"params": head, "use_muon": False, "lr": 0.03}]


def _backward(net: _Net, x: torch.Tensor, drop: tuple[str, ...] = ()) -> None:
    net(x).square().mean().backward()
    for name, p in net.named_parameters():
        if name in drop:
            p.grad = None


def _pair(hp: dict, device: torch.device = CPU) -> tuple[_Net, MuSGD, _Net, FusedMuSGD]:
    net = _Net().to(device)
    ours = copy.deepcopy(net)
    return net, MuSGD(_groups(net), **hp), ours, FusedMuSGD(_groups(ours), **hp)


HPARAMS = [
    dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4),
    dict(lr=0.02, momentum=0.5, nesterov=False, weight_decay=0.0, muon=0.3, sgd=0.7),
    dict(lr=0.01, momentum=0.937, nesterov=False, weight_decay=0.1),
]
# step -> params without a grad that step (a muon weight, an SGD bias, the head's bias)
DROPS = {1: ("fc.weight", "bn.bias"), 2: ("head.bias",)}


def _backward_all(pairs, drop: tuple[str, ...] = ()) -> None:
    """One step's grads in every (model, optimizer) pair: the same batch, ``drop`` left without."""
    x = torch.randn(4, 3, 6, 6, device=next(pairs[0][0].parameters()).device)
    for model, opt in pairs:
        opt.zero_grad()
        _backward(model, x, drop)


@pytest.mark.parametrize("hp", HPARAMS)
def test_torch_path_equals_musgd_bit_for_bit(hp):
    net, stock, ours, fused = _pair(hp)
    for step in range(4):
        _backward_all([(net, stock), (ours, fused)], DROPS.get(step, ()))
        stock.step()
        fused.step()
        for (name, p), q in zip(net.named_parameters(), ours.parameters()):
            assert torch.equal(p, q), (step, name)
    for p, q in zip(net.parameters(), ours.parameters()):
        assert stock.state[p].keys() == fused.state[q].keys()
        for key, value in stock.state[p].items():
            assert torch.equal(value, fused.state[q][key]), key


@pytest.mark.parametrize("hp", HPARAMS)
def test_kernels_step_matches_musgd_from_the_same_state(hp, kernels):
    """Each step from identical weights and states (bfloat16 Newton-Schulz would magnify the
    float32 rounding differences of earlier steps): every weight and state within float32 tolerance."""
    net, stock, ours, fused = _pair(hp, DEVICE)
    for step in range(4):
        _backward_all([(net, stock), (ours, fused)], DROPS.get(step, ()))
        fused.step()
        stock.step()
        for (name, p), q in zip(net.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q, p, **_tol(name, hp),
                                       msg=lambda m, s=step, n=name: f"step {s} {n}: {m}")
            assert stock.state[p].keys() == fused.state[q].keys()
            for key, value in stock.state[p].items():
                torch.testing.assert_close(fused.state[q][key], value, **_tol(name, hp, key),
                                           msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
        with torch.no_grad():  # both continue from our step
            for p, q in zip(net.parameters(), ours.parameters()):
                p.copy_(q)
        stock.load_state_dict(copy.deepcopy(fused.state_dict()))  # load_state_dict aliases tensors
    assert ours.pw.weight.is_contiguous(memory_format=torch.channels_last)


def _train(pairs, steps: int) -> None:
    for _ in range(steps):
        _backward_all(pairs)
        for _, opt in pairs:
            opt.step()


@pytest.mark.parametrize("direction", ["ours_to_musgd", "musgd_to_ours"])
def test_state_dict_round_trips_with_musgd(direction):
    hp = HPARAMS[0]
    net, stock, ours, fused = _pair(hp)
    _train([(net, stock), (ours, fused)], 2)
    source, target_net, target_cls = (fused, net, MuSGD) if direction == "ours_to_musgd" else \
        (stock, ours, FusedMuSGD)
    sd = source.state_dict()
    target = target_cls(_groups(target_net), **hp)
    target.load_state_dict(copy.deepcopy(sd))  # as from a checkpoint: no tensors shared
    if direction == "ours_to_musgd":
        stock = target
    else:
        fused = target
    _train([(net, stock), (ours, fused)], 2)
    for p, q in zip(net.parameters(), ours.parameters()):
        assert torch.equal(p, q)
    assert fused.state_dict()["param_groups"] == stock.state_dict()["param_groups"]


def test_kernels_continue_from_a_musgd_state_dict(kernels):
    hp = HPARAMS[0]
    net, stock, ours, _ = _pair(hp, DEVICE)
    _train([(net, stock)], 2)
    ours.load_state_dict(net.state_dict())
    fused = FusedMuSGD(_groups(ours), **hp)
    fused.load_state_dict(copy.deepcopy(stock.state_dict()))
    _train([(net, stock), (ours, fused)], 1)
    for (name, p), q in zip(net.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, **_tol(name, hp), msg=lambda m, n=name: f"{n}: {m}")


def test_kernels_skip_everything_on_found_inf(kernels):
    """A step GradScaler skips leaves weights and both momenta as they were (the Muon momentum
    is written by the launch, which the flag skips)."""
    _, _, ours, fused = _pair(HPARAMS[0], DEVICE)
    _train([(ours, fused)], 1)
    before = [p.detach().clone() for p in ours.parameters()]
    states = [{k: v.clone() for k, v in fused.state[p].items()} for p in ours.parameters()]
    fused.zero_grad()
    _backward(ours, torch.randn(4, 3, 6, 6, device=DEVICE))
    fused.found_inf = torch.ones(1, device=DEVICE)
    fused.step()
    for p, b, saved in zip(ours.parameters(), before, states):
        assert torch.equal(p, b)
        assert saved.keys() == fused.state[p].keys()
        for k, v in saved.items():
            assert torch.equal(fused.state[p][k], v), k
            assert v.abs().sum() > 0, k  # a trained state, not a fresh one


def test_a_bias_in_a_muon_group_is_refused_with_its_index():
    net = _Net()
    with pytest.raises(ValueError, match="param 1 of a use_muon group has shape \\(8,\\)"):
        FusedMuSGD([{"params": [net.conv.weight, net.conv.bias], "use_muon": True}])


@pytest.mark.parametrize("key", ["lr", "momentum", "weight_decay"])
def test_a_negative_hyperparameter_is_refused(key):
    with pytest.raises(ValueError, match=f"{key} must be a number >= 0"):
        FusedMuSGD(_Net().parameters(), **{key: -0.1})


CLIPS = {"norm": dict(max_grad_norm=0.05), "value": dict(max_grad_value=0.01)}


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_clipping_in_the_step_equals_clipping_the_grads_before_musgd(clip, path, scaled, request):
    """Grads clipped inside the step (scaled ones, GradScaler's ``grad_scale``, unscaled first;
    unscaled ones, bf16 or float32 training, on the kernels in one statistics pass), against
    MuSGD after ``clip_grad_norm_`` / ``clip_grad_value_``: bit for bit on the torch path with
    value clipping, within float32 tolerance otherwise, each step from identical weights and states."""
    device = CPU
    if path == "kernels":
        request.getfixturevalue("kernels")
        device = DEVICE
    hp = HPARAMS[0]
    net, stock, ours, _ = _pair(hp, device)
    fused = FusedMuSGD(_groups(ours), **hp, **CLIPS[clip])
    scale = 1024.0 if scaled else 1.0  # a power of two: the scaled grads are the stock grads times it
    for step in range(3):
        x = torch.randn(4, 3, 6, 6, device=device)
        while True:  # a batch whose grads the clip reaches, whatever the seed: doubled until they do
            stock.zero_grad()
            _backward(net, x)
            grads = [p.grad for p in net.parameters()]
            if clip == "norm":
                active = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) > 0.05
            else:
                active = max(g.abs().max() for g in grads) > 0.01
            if active:
                break
            x = x * 2
        fused.zero_grad()
        (ours(x).square().mean() * scale).backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        else:
            torch.nn.utils.clip_grad_value_(net.parameters(), 0.01)
        if scaled:
            fused.grad_scale = torch.tensor(scale, device=device)
        stock.step()
        fused.step()
        for (name, p), q in zip(net.named_parameters(), ours.parameters()):
            if path == "torch" and clip == "value":
                assert torch.equal(q, p), (step, name)
            else:  # the norm sums in group order, clip_grad_norm_ in module order: last bits differ
                torch.testing.assert_close(q, p, **_tol(name, hp),
                                           msg=lambda m, s=step, n=name: f"step {s} {n}: {m}")
            for key, value in stock.state[p].items():
                torch.testing.assert_close(fused.state[q][key], value, **_tol(name, hp, key),
                                           msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
        with torch.no_grad():  # both continue from our step
            for p, q in zip(net.parameters(), ours.parameters()):
                p.copy_(q)
        stock.load_state_dict(copy.deepcopy(fused.state_dict()))


# shapes for the batched Newton-Schulz: wide, tall, square, 1-row, conv filters (one
# channels_last), long sides spanning more than one batch, a 2-D param stored transposed
NS_SHAPES = [(8, 3, 3, 3), (12, 8, 1, 1), (6, 192), (40, 6), (1, 5), (17, 17), (3, 700), (33, 2, 3, 3)]


def _memory_matrix(u: torch.Tensor) -> torch.Tensor:
    """``u`` as the matrix MuSGD orthogonalizes: ``(d[0], rest)`` in its memory order."""
    if not u.is_contiguous() and u.ndim == 4 and u.is_contiguous(memory_format=torch.channels_last):
        return u.permute(0, 2, 3, 1).flatten(1)
    return u.reshape(u.size(0), -1)


def _padded_reference(plan, updates: list[torch.Tensor], steps: int = 5) -> list[torch.Tensor]:
    """``scale * NS_steps`` of each update in torch, padded into the plan's batches (``plan.layout``)."""
    from trainfuse.optim.newton_schulz import _NS_EPS, _iterate

    out = [None] * len(updates)
    for rows, cols, members in plan.layout:
        X = torch.zeros(len(members), rows, cols, device=updates[0].device)
        mats = []
        for k, i in enumerate(members):
            m = _memory_matrix(updates[i])
            tall = m.size(0) > m.size(1)
            m = m.t() if tall else m
            X[k, : m.size(0), : m.size(1)] = m
            mats.append((i, m.shape, tall))
        Y = X.bfloat16()
        Y /= Y.norm(dim=(-2, -1), keepdim=True) + _NS_EPS
        Y = _iterate(Y, steps=steps).float()
        for k, (i, (r, c), tall) in enumerate(mats):
            u = updates[i]
            y = Y[k, :r, :c] * max(1, u.size(-2) / u.size(-1)) ** 0.5
            out[i] = y.t() if tall else y
    return out


def test_an_unscaled_step_clipped_by_norm_takes_one_statistics_pass(kernels, monkeypatch):
    """Without GradScaler, clipping by norm on the kernels: the pass that gives Newton-Schulz its
    clip coefficient is the one the update launch clips with (one statistics launch a step)."""
    from trainfuse.optim import engine

    passes = []
    launch_stats = engine.launch_stats
    monkeypatch.setattr(engine, "launch_stats", lambda *a, **k: passes.append(1) or launch_stats(*a, **k))
    hp = HPARAMS[0]
    _, _, ours, _ = _pair(hp, DEVICE)
    fused = FusedMuSGD(_groups(ours), **hp, max_grad_norm=0.05)
    for step in range(2):
        fused.zero_grad()
        ours(torch.randn(4, 3, 6, 6, device=DEVICE)).square().mean().backward()
        fused.step()
        assert len(passes) == step + 1


@pytest.mark.parametrize("direct", [True, False], ids=["into-targets", "through-a-buffer"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_newton_schulz_pads_as_its_layout_says(kernels, nesterov, direct):
    """The kernels' padded batches (Triton gather and scatter around the matmuls) against the same
    padding in torch, bit for bit; and against MuSGD's own batching (``orthogonalized``) on CPU,
    within what another summation order leaves after five bfloat16 iterations. Targets laid out
    as their matrices take the scatter's stores; a transposed one sends all through a buffer."""
    from trainfuse.optim.musgd import _muon_momentum
    from trainfuse.optim.newton_schulz import BatchedNewtonSchulz, orthogonalized

    grads = [torch.randn(s, device=DEVICE) for s in NS_SHAPES]
    grads[1] = grads[1].contiguous(memory_format=torch.channels_last)
    if not direct:  # not contiguous: MuSGD takes a row-major copy
        grads.append(torch.randn(9, 4, device=DEVICE).t())
    bufs = [torch.randn_like(g) for g in grads]
    targets = [torch.full_like(g, float("nan")) for g in grads]
    plan = BatchedNewtonSchulz(targets)
    assert plan.direct == direct
    assert plan.batches < len(grads)  # padded together
    assert sorted(i for _, _, members in plan.layout for i in members) == list(range(len(grads)))
    plan.run(bufs, grads, 0.9, nesterov, targets)
    updates = _muon_momentum(bufs, grads, 0.9, nesterov, in_place=False)
    for k, (t, e) in enumerate(zip(targets, _padded_reference(plan, updates))):
        assert t.stride() == grads[k].stride()
        assert torch.equal(_memory_matrix(t), e), f"tensor {k}"
    assert plan.key == BatchedNewtonSchulz.key_of(targets)
    if DEVICE.type == "cpu":
        # The padded matmuls accumulate in another order, and five bfloat16 iterations grow that
        # last-bit difference in a few entries: at most 3.8 * 2**-7 of the largest entry over
        # 3,000 seeds, 0.66 * 2**-7 on average over a tensor (the bfloat16 result's own error
        # against float64 reaches 17 * 2**-7). Padding in the wrong place moves entries by the
        # order of the largest one.
        for k, (t, e) in enumerate(zip(targets, orthogonalized(updates))):
            largest = float(e.abs().max())
            torch.testing.assert_close(t, e, rtol=0, atol=2**-4 * largest,
                                       msg=lambda m, k=k: f"tensor {k}: {m}")
            assert float((t - e).abs().mean()) <= 2**-7 * largest, f"tensor {k}"


@pytest.mark.parametrize(("device_momentum", "steps"), [(False, 5), (True, 5), (False, 1), (False, 0)],
                         ids=["number", "device-tensor", "one-iteration", "no-iteration"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_newton_schulz_lerps_as_torch_muon(kernels, nesterov, device_momentum, steps):
    """``torch.optim.Muon``'s blend (``lerp``) with the grads in the targets, as FusedMuon passes
    them: Nesterov's second lerp written into the targets and gathered from there, bit for bit
    the padded torch reference of ``m.lerp(g, 1 - mu)`` and ``g.lerp(u, mu)``, for any iteration
    count (the last product lands in the gathered buffer); the momentum buffers untouched."""
    from trainfuse.optim.newton_schulz import BatchedNewtonSchulz

    shapes = [(24, 40), (40, 24), (8, 3, 3, 3), (5, 64), (64, 5), (17, 17)]
    grads = [torch.randn(s, device=DEVICE) for s in shapes]
    bufs = [torch.randn_like(g) for g in grads]
    kept = [b.clone() for b in bufs]
    targets = [g.clone() for g in grads]
    plan = BatchedNewtonSchulz(targets, steps=steps)
    assert plan.direct
    mu = 0.95
    momentum = torch.tensor(mu, dtype=torch.float64, device=DEVICE) if device_momentum else mu
    plan.run(bufs, targets, momentum, nesterov, targets, lerp=True)
    weight = torch.tensor(1 - mu, dtype=torch.float32) if device_momentum else 1 - mu
    updates = [b.lerp(g, weight.to(DEVICE) if device_momentum else weight) for b, g in zip(bufs, grads)]
    if nesterov:
        updates = [g.lerp(u, torch.tensor(mu, dtype=torch.float32, device=DEVICE) if device_momentum else mu)
                   for g, u in zip(grads, updates)]
    for k, (t, e) in enumerate(zip(targets, _padded_reference(plan, updates, steps))):
        assert torch.equal(_memory_matrix(t), e), f"tensor {k}"
    for b, k in zip(bufs, kept):
        assert torch.equal(b, k)


def test_the_gathers_blend_reads_the_momentum_buffers_where_they_are_now(kernels):
    """FusedMuon's blend inside the gather reads the momentum buffers at the addresses the plan's
    table holds: buffers at new addresses (a loaded state_dict) are read there; buffers laid out
    otherwise than the targets take torch's foreach blend instead, to the same result."""
    from trainfuse.optim.newton_schulz import BatchedNewtonSchulz

    shapes = [(24, 40), (40, 24), (17, 17)]
    grads = [torch.randn(s, device=DEVICE) for s in shapes]
    targets = [g.clone() for g in grads]
    plan = BatchedNewtonSchulz(targets)

    def step(bufs):
        for t, g in zip(targets, grads):
            t.copy_(g)
        plan.run(bufs, targets, 0.9, True, targets, lerp=True)
        return [t.clone() for t in targets]

    bufs = [torch.randn_like(g) for g in grads]
    first = step(bufs)
    assert all(torch.equal(a, b) for a, b in zip(step([b.clone() for b in bufs]), first))  # moved
    doubled = step([2 * b for b in bufs])
    assert not any(torch.equal(a, b) for a, b in zip(doubled, first))
    transposed = step([b.t().contiguous().t() for b in bufs])  # column-major: the foreach blend
    for a, b in zip(transposed, first):
        if DEVICE.type == "cpu":
            assert torch.equal(a, b)
        else:  # the fused multiply-adds may round the blend's last bit otherwise
            torch.testing.assert_close(a, b, rtol=0, atol=2**-4 * float(b.abs().max()))


def test_padding_joins_matrices_only_where_it_costs_less_than_a_batch():
    """GPT-2's 48 hidden matrices, 768 rows by three widths: padded into one batch, the narrower
    ones would cost more matmul work than their own batches' launches; one matrix of each width
    pads for less, and small matrices share one batch."""
    from trainfuse.optim.newton_schulz import BatchedNewtonSchulz

    widths = [768] * 12 + [2304] * 12 + [3072] * 24
    gpt2 = BatchedNewtonSchulz([torch.zeros(768, n) for n in widths])
    assert [(M, N, len(m)) for M, N, m in gpt2.layout] == [(768, 768, 12), (768, 2304, 12), (768, 3072, 24)]
    assert BatchedNewtonSchulz([torch.zeros(768, n) for n in (768, 2304, 3072)]).batches == 1
    assert BatchedNewtonSchulz([torch.zeros(16, n) for n in (16, 40, 100)]).batches == 1
    assert BatchedNewtonSchulz([torch.zeros(16, n) for n in (16, 200)]).batches == 2  # past 8x
