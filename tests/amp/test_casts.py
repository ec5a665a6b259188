"""fuse_casts / master weights: trajectories against a torch reference that keeps float32 masters by
hand, checkpoints, fp32_state_dict, float16 with GradScaler (interpreter on CPU)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import trainfuse
from trainfuse.amp import GradScaler, fp32_state_dict, fuse_casts

REFERENCE = {trainfuse.FusedAdamW: torch.optim.AdamW, trainfuse.FusedSGD: torch.optim.SGD}
HPARAMS = {trainfuse.FusedAdamW: dict(lr=1e-2, weight_decay=0.1),
           trainfuse.FusedSGD: dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)}


def _model(device):
    return nn.Sequential(nn.Linear(12, 40), nn.LayerNorm(40), nn.GELU(), nn.Linear(40, 5)).to(device)


def _loss(model, x, dtype):
    with torch.autocast(x.device.type, dtype=dtype):
        return model(x).float().pow(2).mean()


@pytest.mark.parametrize("cls", list(REFERENCE), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("own_launch", [False, True], ids=["same-launch", "own-launch"])
def test_fuse_casts_trajectory_matches_hand_kept_masters(cls, dtype, own_launch, kernels, device,
                                                         monkeypatch):
    if own_launch:  # plans with masters take their own launch shape: chunks must follow it
        from trainfuse._multi_tensor.tables import master_config

        monkeypatch.setattr(master_config, "block", 16)
        monkeypatch.setattr(master_config, "unroll", 3)
    model = _model(device)
    ref = copy.deepcopy(model)  # float32 masters kept by hand
    originals = [p.detach().clone() for p in model.parameters()]
    params_before = list(model.parameters())
    opt = cls(model.parameters(), **HPARAMS[cls])
    ref_opt = REFERENCE[cls](ref.parameters(), foreach=False, **HPARAMS[cls])
    fuse_casts(model, opt, dtype)

    assert list(model.parameters()) == params_before  # the same Parameter objects
    assert model[0].weight.dtype == dtype and model[3].bias.dtype == dtype
    assert model[1].weight.dtype == torch.float32  # norm layers stay float32
    for p, orig in zip(model.parameters(), originals):
        if p.dtype == dtype:  # seeded from the float32 value, not the rounded one
            assert torch.equal(opt.state[p]["master_param"], orig)

    for _ in range(4):
        x = torch.randn(16, 12, device=device)
        opt.zero_grad()
        _loss(model, x, dtype).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad.dtype == p.dtype
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            master = opt.state[p].get("master_param", p)
            torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
            if p.dtype == dtype:
                assert master.dtype == torch.float32
                for k, v in opt.state[p].items():
                    assert k == "step" or v.dtype == torch.float32, k
                # the 16-bit weight the next forward reads is the master rounded once
                assert torch.equal(p.detach(), master.to(dtype))
    if own_launch:
        from trainfuse._multi_tensor.tables import master_config

        plan = opt.engine.plans.get(next(model.parameters()).device).plan
        assert plan.launch is master_config


def test_master_weights_on_16bit_params_start_from_their_values(kernels, device):
    ps = [nn.Parameter(torch.randn(s, device=device).to(torch.bfloat16)) for s in [(0,), (33,), (7, 9)]]
    start = [p.detach().float() for p in ps]
    opt = trainfuse.FusedAdamW(ps, lr=0.01, master_weights=True)
    refs = [nn.Parameter(s.clone()) for s in start]
    ref_opt = torch.optim.AdamW(refs, lr=0.01, foreach=False)
    for _ in range(3):
        for p, q in zip(ps, refs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, q in zip(ps, refs):
        master = opt.state[p]["master_param"]
        torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
        # the bf16 weight is the master rounded once (the master differs from torch's float32
        # param by the approximate division's ulps, which can round the other way)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize("cls", list(REFERENCE), ids=lambda c: c.__name__)
def test_checkpoint_round_trip_keeps_float32_masters(cls, kernels, device):
    model = _model(device)
    opt = cls(model.parameters(), **HPARAMS[cls])
    fuse_casts(model, opt)
    x = torch.randn(8, 12, device=device)
    for _ in range(2):
        opt.zero_grad()
        _loss(model, x, torch.bfloat16).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    model2 = _model(device)
    opt2 = cls(model2.parameters(), **HPARAMS[cls])
    fuse_casts(model2, opt2)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for p, q in zip(model.parameters(), model2.parameters()):
        for k, v in opt.state[p].items():
            w = opt2.state[q][k]
            if k != "step":  # masters and the states beside them come back as float32
                assert w.dtype == torch.float32, k
            assert torch.equal(v.float(), w.float()), k
    # both continue identically
    opt.zero_grad()
    opt2.zero_grad()
    _loss(model, x, torch.bfloat16).backward()
    _loss(model2, x, torch.bfloat16).backward()
    opt.step()
    opt2.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


class _TiedLM(nn.Module):
    """Embedding, a Linear, and an output layer tied to the embedding (as GPT-2 ties them)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.fc(self.emb(idx))))


def test_embeddings_and_params_tied_to_them_stay_float32(kernels, device):
    """Autocast runs an embedding in its weight's dtype: fuse_casts leaves embeddings float32 by
    default (and an output layer sharing the weight with it), so the activations after them stay
    what autocast gives; the rest trains on float32 masters as before. NORM_LAYERS alone converts
    embeddings too."""
    model = _TiedLM().to(device)
    ref = copy.deepcopy(model)
    opt = trainfuse.FusedAdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    fuse_casts(model, opt)
    assert model.emb.weight.dtype == torch.float32 and model.head.weight is model.emb.weight
    assert model.fc.weight.dtype == torch.bfloat16 and model.fc.bias.dtype == torch.bfloat16
    assert "master_param" not in opt.state[model.emb.weight]
    for _ in range(3):
        idx = torch.randint(0, 10, (8, 5), device=device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(idx)
        assert model.emb(idx).dtype == torch.float32  # as autocast alone leaves it
        out.float().pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(opt.state[p].get("master_param", p), q.detach(), rtol=1e-5, atol=1e-6)

    old = _TiedLM().to(device)
    fuse_casts(old, trainfuse.FusedAdamW(old.parameters()), keep_fp32=trainfuse.amp.NORM_LAYERS)
    assert old.emb.weight.dtype == torch.bfloat16 and old.head.weight is old.emb.weight


def test_fp32_state_dict_loads_into_the_unmodified_model(kernels, device):
    model = _model(device)
    opt = trainfuse.FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
    fuse_casts(model, opt, torch.float16)
    x = torch.randn(8, 12, device=device)
    _loss(model, x, torch.float16).backward()
    opt.step()
    sd = fp32_state_dict(model, opt)
    plain = _model(device)
    plain.load_state_dict(sd)
    assert all(v.dtype == torch.float32 for v in plain.state_dict().values())
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        expected = opt.state[p].get("master_param", p)
        assert torch.equal(q.detach(), expected.detach()), name


def test_fp16_masters_with_grad_scaler_skip_on_inf(kernels, device):
    model = _model(device)
    opt = trainfuse.FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    fuse_casts(model, opt, torch.float16)
    scaler = GradScaler(device.type, init_scale=2.0**8)
    x = torch.randn(8, 12, device=device)
    for it in range(3):
        opt.zero_grad()
        scaler.scale(_loss(model, x, torch.float16)).backward()
        if it == 1:
            model[0].weight.grad.view(-1)[3] = math.inf
        masters = {p: opt.state[p]["master_param"].clone() for p in model.parameters()
                   if "master_param" in opt.state.get(p, {})}
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(m, opt.state[p]["master_param"]) for p, m in masters.items())
        assert changed == (it != 1), it
        assert (scaler.get_scale() < scale) == (it == 1)


def test_fuse_casts_refuses_other_optimizers_and_dtypes(device):
    model = _model(device)
    with pytest.raises(TypeError, match="fused optimizer"):
        fuse_casts(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="bfloat16 or torch.float16"):
        fuse_casts(model, trainfuse.FusedAdamW(model.parameters()), torch.float64)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_torch_path_keeps_masters_too(monkeypatch, device):
    """TRAINFUSE_BACKEND=torch (the CPU default): the same master-weight semantics."""
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
    model = _model(device)
    ref = copy.deepcopy(model)
    opt = trainfuse.FusedAdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    fuse_casts(model, opt)
    for _ in range(2):
        opt.zero_grad()
        _loss(model, torch.randn(4, 12, device=device), torch.bfloat16).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p].get("master_param", p).detach(), q.detach())
