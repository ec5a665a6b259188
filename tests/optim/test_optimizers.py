"""Every fused optimizer of the registry against its stock class (kernels through the interpreter on CPU)."""

from __future__ import annotations

import copy
import inspect
import random

import pytest
import torch

import trainfuse
from tests.optim.reference import (
    OPTIMIZERS,
    SHAPES,
    TOL,
    TORCH_CLASS,
    assert_step_matches,
    random_hparams,
    snapshot,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _params(shapes, dtype, device, memory_format=None):
    ps = []
    for s in shapes:
        p = torch.randn(s, device=device).to(dtype)
        if memory_format is not None and p.dim() == 4:
            p = p.to(memory_format=memory_format)
        ps.append(torch.nn.Parameter(p))
    return ps


def _fresh_grads(params, none_at=()):
    grads = []
    for i, p in enumerate(params):
        g = None if i in none_at else torch.randn_like(p)
        p.grad = g
        grads.append(g)
    return grads


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", range(3))
def test_each_step_matches_torch_in_float64(cls, dtype, config, kernels, device):
    rng = random.Random(torch.initial_seed() + config)
    params = _params(SHAPES, dtype, device)
    hp_a, hp_b = random_hparams(cls, rng), random_hparams(cls, rng)
    opt = cls([{"params": params[:4], **hp_a}, {"params": params[4:], **hp_b}])
    for step in range(3):
        before = snapshot(opt)
        grads = _fresh_grads(params, none_at=(2,) if step == 1 else ())
        opt.step()
        assert_step_matches(opt, *before, grads, dtype, msg=f"{hp_a} {hp_b} step {step}")


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_float32_trajectory_matches_torch_optim(cls, kernels, device):
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    ours = _params(SHAPES, torch.float32, device)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = cls(ours, **hp), TORCH_CLASS[cls](theirs, **hp)
    for _ in range(5):
        for p, q in zip(ours, theirs):
            q.grad = torch.randn_like(p)
            p.grad = q.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_cpu_default_path_is_identical_to_torch_optim(cls, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "auto")
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    ours = _params(SHAPES, torch.float32, "cpu")
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = cls(ours, **hp), TORCH_CLASS[cls](theirs, **hp)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            q.grad = torch.randn_like(p)
            p.grad = q.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
    sa, sb = a.state_dict(), b.state_dict()
    for i in sb["state"]:
        for key, v in sb["state"][i].items():
            assert torch.equal(sa["state"][i][key], v), key


# the engine's tables, shared by every optimizer: AdamW's rows carry the most operands (each
# optimizer's update math: the tests above)
@pytest.mark.parametrize("cls", [trainfuse.FusedAdamW], ids=lambda c: c.__name__)
def test_thousand_tiny_tensors_in_one_launch(cls, kernels, device):
    shapes = [(1 + i % 7,) for i in range(1100)] + [(0,)]
    dtype = torch.float32
    params = _params(shapes, dtype, device)
    opt = cls(params, lr=0.01, **({"momentum": 0.9} if cls is trainfuse.FusedSGD else {}))
    before = snapshot(opt)
    grads = _fresh_grads(params)
    opt.step()
    assert_step_matches(opt, *before, grads, dtype)
    plan = opt.engine.plans.get(params[0].device).plan
    assert plan.nchunks == len(shapes)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_state_dict_loads_into_torch_and_training_continues(cls, dtype, kernels, device):
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    ours = _params(SHAPES, dtype, device)
    opt = cls(ours, **hp)
    for _ in range(2):
        _fresh_grads(ours)
        opt.step()
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    topt = TORCH_CLASS[cls](theirs, **hp)
    sd = opt.state_dict()
    topt.load_state_dict(copy.deepcopy(sd))  # as if saved and loaded: no shared tensors
    assert set(topt.state_dict()["param_groups"][0]) == set(sd["param_groups"][0])
    for _ in range(2):
        before = snapshot(opt)
        grads = _fresh_grads(ours)
        for q, g in zip(theirs, grads):
            q.grad = g.clone()
        opt.step()
        topt.step()
        assert_step_matches(opt, *before, grads, dtype)
    for p, q in zip(ours, theirs):
        # torch.optim rounds every intermediate to bf16/fp16, we round once: the two runs may drift
        # apart by a few ulps of the params' scale (~1); the float64 check above is the exact one
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(p.float(), q.float(), rtol=4 * eps, atol=eps)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_torch_state_dict_loads_into_ours_and_training_continues(cls, kernels, device):
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    theirs = _params(SHAPES, torch.float32, device)
    topt = TORCH_CLASS[cls](theirs, **hp)
    for _ in range(2):
        _fresh_grads(theirs)
        topt.step()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    opt = cls(ours, **hp)
    opt.load_state_dict(copy.deepcopy(topt.state_dict()))
    for _ in range(2):
        before = snapshot(opt)
        grads = _fresh_grads(ours)
        for q, g in zip(theirs, grads):
            q.grad = g.clone()
        opt.step()
        topt.step()
        assert_step_matches(opt, *before, grads, torch.float32)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    expected_keys = {k: set(v) for k, v in topt.state_dict()["state"].items()}
    assert {k: set(v) for k, v in opt.state_dict()["state"].items()} == expected_keys


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_state_dict_layout_is_torchs(cls, kernels, device):
    params = _params([(4, 3), (5,)], torch.float32, device)
    hp = {"momentum": 0.9} if "momentum" in inspect.signature(cls).parameters else {}
    opt = cls(params, lr=0.1, **hp)
    _fresh_grads(params)
    opt.step()
    sd = opt.state_dict()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = TORCH_CLASS[cls](ref_params, lr=0.1, **hp)
    for p, q in zip(params, ref_params):
        q.grad = p.grad.detach().clone()
    ref.step()
    ref_sd = ref.state_dict()
    assert set(sd["param_groups"][0]) == set(ref_sd["param_groups"][0])
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == set(ref_sd["state"][i]) and st
        if "step" in st:
            assert torch.is_tensor(st["step"]) and st["step"].dim() == 0 and float(st["step"]) == 1
            assert st["step"].dtype in (torch.float32, torch.float64)
        for key, v in st.items():
            if key != "step":
                assert v.shape == p.shape and v.dtype == p.dtype and v.device == p.device


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grad_scaler_unscales_and_skips_on_inf(cls, dtype, kernels, device):
    if device.type == "cuda" and dtype == torch.bfloat16:
        pytest.skip("torch's GradScaler has no CUDA bf16 unscale; test_grad_scale_protocol covers it")
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    params = _params(SHAPES, dtype, device)
    opt = cls(params, **hp)
    scaler = torch.amp.GradScaler(device.type, init_scale=256.0, growth_interval=1)
    for step in range(3):
        before = snapshot(opt)
        grads = _fresh_grads(params)
        unscaled = [g.clone() for g in grads]
        scale = float(scaler.scale(torch.ones((), device=device)))  # what loss.backward() scales by
        for g in grads:
            g.mul_(scale)
        if step == 1:  # an overflow: nothing may change, and the scale backs off
            grads[4].view(-1)[3] = float("inf")
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if step == 1:
            assert scaler.get_scale() == scale_before * 0.5
            after = snapshot(opt)
            for a, b in zip(after[0], before[0]):
                assert torch.equal(a, b)
            for sa, sb in zip(after[1], before[1]):
                assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        else:
            assert scaler.get_scale() == scale_before * 2.0
            assert_step_matches(opt, *before, unscaled, dtype, msg=f"step {step}")
            for g, u in zip(grads, unscaled):  # left unscaled, like torch's fused optimizers
                torch.testing.assert_close(g.float(), u.float(), **TOL[dtype])


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_lr_scheduler_changes_lr_every_step(cls, kernels, device):
    ours = _params(SHAPES, torch.float32, device)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = {"momentum": 0.9, "nesterov": True} if cls is trainfuse.FusedSGD else {}
    a, b = cls(ours, lr=0.1, **kw), TORCH_CLASS[cls](theirs, lr=0.1, **kw)
    sa = torch.optim.lr_scheduler.OneCycleLR(a, max_lr=0.2, total_steps=6)
    sb = torch.optim.lr_scheduler.OneCycleLR(b, max_lr=0.2, total_steps=6)
    for _ in range(5):
        for p, q in zip(ours, theirs):
            q.grad = torch.randn_like(p)
            p.grad = q.grad.clone()
        a.step()
        b.step()
        sa.step()
        sb.step()
        assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"]
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_add_param_group_joins_the_launch(cls, kernels, device):
    first, second = _params([(5, 3)], torch.float32, device), _params([(70,)], torch.float32, device)
    opt = cls(first, lr=0.1)
    _fresh_grads(first)
    opt.step()
    opt.add_param_group({"params": second, "lr": 0.01, "weight_decay": 0.1})
    before = snapshot(opt)
    grads = _fresh_grads(first + second)
    opt.step()
    assert_step_matches(opt, *before, grads, torch.float32)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_channels_last_params_with_contiguous_grads(cls, kernels, device):
    params = _params([(4, 3, 3, 5), (6, 2, 1, 3)], torch.float32, device, torch.channels_last)
    opt = cls(params, lr=0.05, weight_decay=0.01)
    for _ in range(2):
        before = snapshot(opt)
        grads = []
        for p in params:
            p.grad = torch.randn(p.shape, device=device).contiguous()
            grads.append(p.grad)
        opt.step()
        assert_step_matches(opt, *before, grads, torch.float32)
    assert params[0].is_contiguous(memory_format=torch.channels_last)



@pytest.mark.parametrize("cls", [trainfuse.FusedAdamW, trainfuse.FusedSGD])
def test_a_moved_grad_in_another_memory_order_is_not_patched_in(cls, kernels, device):
    """The hot path patches moved grads in by address only when each keeps its param's memory
    order (channels_last, contiguous, or a param's own strides): a grad assigned in another order
    takes the conformed path, and every step matches torch."""
    params = _params([(4, 3, 3, 5), (6, 2, 1, 3)], torch.float32, device, torch.channels_last)
    params += _params([(5, 7), (3,)], torch.float32, device)
    opt = cls(params, lr=0.05, **({"momentum": 0.9} if cls is trainfuse.FusedSGD else {}))
    orders = ["same", "same", "contiguous", "same", "transposed", "same"]
    for order in orders:
        grads = []
        for p in params:
            g = torch.randn_like(p)  # preserve_format: the param's own order
            if order == "contiguous":
                g = g.contiguous()
            elif order == "transposed" and p.dim() == 2:
                g = torch.randn(p.shape[::-1], device=device).t()
            p.grad = g
            grads.append(g)
        before = snapshot(opt)
        opt.step()
        assert_step_matches(opt, *before, grads, torch.float32)
        plan = opt.engine.plans.get(params[0].device).plan
        assert plan.volatile == (order != "same")  # conformed copies for the other orders
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_unaligned_param_views(cls, kernels, device):
    base = torch.randn(1000, device=device)
    params = [torch.nn.Parameter(base[1:301]), torch.nn.Parameter(base[303:310].view(7, 1))]
    opt = cls(params, lr=0.05)
    before = snapshot(opt)
    grads = _fresh_grads(params)
    opt.step()
    assert not opt.engine.plans.get(params[0].device).plan.aligned
    assert_step_matches(opt, *before, grads, torch.float32)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_tables_are_reused_and_rebuilt_when_storage_moves(cls, kernels, device):
    params = _params(SHAPES, torch.float32, device)
    opt = cls(params, lr=0.05)
    _fresh_grads(params)
    opt.step()
    plan = opt.engine.plans.get(params[0].device).plan
    opt.step()  # same grads, same addresses
    assert opt.engine.plans.get(params[0].device).plan is plan
    params[2].data = params[2].data.clone()  # the param's storage moves
    before = snapshot(opt)
    grads = [p.grad for p in params]
    opt.step()
    assert opt.engine.plans.get(params[0].device).plan is not plan
    assert_step_matches(opt, *before, grads, torch.float32)


@pytest.mark.parametrize("cls", [trainfuse.FusedAdamW, trainfuse.FusedSGD])
def test_grads_at_new_addresses_patch_the_tables_in_place(cls, kernels, device):
    """zero_grad(set_to_none=True) and a backward that allocates elsewhere: the plan is kept, its
    grad column rewritten (the device table in place), and every step still matches torch."""
    params = _params(SHAPES, torch.float32, device)
    opt = cls(params, lr=0.05, **({"momentum": 0.9} if cls is trainfuse.FusedSGD else {}))
    _fresh_grads(params)
    opt.step()
    entry = opt.engine.plans.get(params[0].device)
    plan, rows = entry.plan, entry.plan.rows
    hold = []
    for _ in range(3):
        hold.append(torch.empty(7, device=device))  # shifts where the next grads land
        _fresh_grads(params)
        before = snapshot(opt)
        grads = [p.grad for p in params]
        old_addresses = list(entry.grad_addresses)
        opt.step()
        assert opt.engine.plans.get(params[0].device) is entry and entry.plan is plan and plan.rows is rows
        assert entry.grad_addresses == [g.data_ptr() for g in grads] != old_addresses  # patched
        assert_step_matches(opt, *before, grads, torch.float32)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_hparams_change_in_place_and_refresh_writes_them(cls, kernels, device):
    """A new lr is written into the same device table (a replayed CUDA graph holds its address);
    refresh_hparams writes it without a step, and the next step matches torch."""
    params = _params(SHAPES, torch.float32, device)
    opt = cls(params, lr=0.05)
    _fresh_grads(params)
    opt.step()
    (values, table), = opt.engine.hparams.by_device.values()
    address = table.data_ptr()
    opt.param_groups[0]["lr"] = 0.01
    opt.refresh_hparams()
    (values, table), = opt.engine.hparams.by_device.values()
    row = [float(v) for v in opt.hparams_row(opt.param_groups[0])]  # the new lr, as the class stores it
    assert table.data_ptr() == address and values[: len(row)] == row
    assert table[: len(row)].tolist() == row  # on the device
    before = snapshot(opt)
    grads = _fresh_grads(params)
    opt.step()
    assert_step_matches(opt, *before, grads, torch.float32)


def test_multi_chunk_tensors_bump_step_exactly_once(kernels, device):
    params = _params([(kernels.chunk * 5 + 3,), (kernels.chunk,), (0,)], torch.float32, device)
    opt = trainfuse.FusedAdamW(params)
    for n in range(1, 4):
        _fresh_grads(params)
        opt.step()
        assert [float(opt.state[p]["step"]) for p in params] == [n, n, n]
    assert int(opt.engine.plans.get(params[0].device).plan.arrivals.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mixed_dtypes_share_one_launch(dtype, kernels, device):
    params = [torch.nn.Parameter(torch.randn(n, device=device, dtype=d))
              for n, d in ((257, torch.float32), (130, dtype), (9, torch.float32))]
    opt = trainfuse.FusedAdamW(params, lr=0.1)
    for _ in range(2):
        before = snapshot(opt)
        grads = _fresh_grads(params)
        opt.step()
        assert_step_matches(opt, *before, grads, dtype)
    plan = opt.engine.plans.get(params[0].device).plan
    assert plan.codes == 0b1 | (0b10 if dtype == torch.bfloat16 else 0b100)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_closure_and_step_hooks_run_like_torch(cls, kernels, device):
    params = _params([(6, 5)], torch.float32, device)
    opt = cls(params, lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    x = torch.randn(5, device=device)

    def closure():
        opt.zero_grad()
        loss = (params[0] @ x).pow(2).sum()
        loss.backward()
        calls.append("closure")
        return loss

    before = snapshot(opt)
    loss = opt.step(closure)
    assert calls == ["pre", "closure", "post"]
    assert torch.is_tensor(loss) and loss.requires_grad
    assert_step_matches(opt, *before, [params[0].grad], torch.float32)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grad_scale_protocol(cls, dtype, kernels, device):
    """The attributes GradScaler sets: grad_scale divides the grads, found_inf != 0 skips all."""
    params = _params(SHAPES, dtype, device)
    opt = cls(params, **random_hparams(cls, random.Random(torch.initial_seed())))
    for found in (0.0, 1.0, 0.0):
        before = snapshot(opt)
        grads = _fresh_grads(params)
        unscaled = [g.clone() for g in grads]
        for g in grads:
            g.mul_(64.0)
        opt.grad_scale = torch.tensor(64.0, device=device)
        opt.found_inf = torch.tensor(found, device=device)
        opt.step()
        del opt.grad_scale, opt.found_inf
        if found:
            after = snapshot(opt)
            assert all(torch.equal(a, b) for a, b in zip(after[0], before[0]))
            for sa, sb in zip(after[1], before[1]):
                assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        else:
            assert_step_matches(opt, *before, unscaled, dtype)


def test_sgd_first_step_skipped_on_inf_still_seeds_the_buffer_next_step(kernels, device):
    params = _params([(40,), (3, 7)], torch.float32, device)
    # dampening makes a wrongly "continued" buffer (0.5 * g) differ from a seeded one (g)
    opt = trainfuse.FusedSGD(params, lr=0.1, momentum=0.9, dampening=0.5)
    _fresh_grads(params)
    opt.grad_scale = torch.tensor(1.0, device=device)
    opt.found_inf = torch.tensor(1.0, device=device)
    opt.step()  # skipped: the next step must still be a first step (buffer = gradient)
    del opt.grad_scale, opt.found_inf
    before = snapshot(opt)
    before[1][:] = [{} for _ in params]  # torch's view: no momentum buffer yet
    grads = _fresh_grads(params)
    opt.step()
    assert_step_matches(opt, *before, grads, torch.float32)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_torch_backend_and_kernels_agree(cls, monkeypatch, device):
    hp = random_hparams(cls, random.Random(torch.initial_seed()))
    a = _params(SHAPES, torch.float32, device)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = cls(a, **hp), cls(b, **hp)
    for _ in range(3):
        for p, q in zip(a, b):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
        oa.step()
        monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
        ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_torch_state_dict_passes_an_empty_rank_state_through():
    """FSDP's full optimizer state lives on rank zero: the other ranks' checkpoints get ``{}``."""
    from trainfuse.optim.portable import torch_state_dict

    assert torch_state_dict({}) == {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_adams_rolled_loop_gives_the_unrolled_loops_bits(dtype, amsgrad, kernels, device, monkeypatch):
    """``TRAINFUSE_ADAM_ROLLED``'s update (its blocks in a rolled loop, 16-bit rows' blocks
    doubled) moves params and states to the unrolled update's bits, step after step, partial
    last chunks included; four blocks a work item, so the 16-bit rows' doubled blocks still loop."""
    from trainfuse.optim import adam

    monkeypatch.setattr(kernels, "unroll", 4)

    params = _params(SHAPES, dtype, device)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    unrolled, rolled = (trainfuse.optim.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
                        for ps in (params, twin))
    rolled.chunk_fn, rolled.wide16 = adam._adam_chunk_rolled, True
    assert unrolled.chunk_fn is adam._adam_chunk and not unrolled.wide16
    for step in range(3):
        for p, q in zip(params, twin):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        unrolled.step()
        rolled.step()
        for p, q in zip(params, twin):
            assert torch.equal(p, q), step
            for k, v in unrolled.state[p].items():
                assert torch.equal(v, rolled.state[q][k]), (step, k)
