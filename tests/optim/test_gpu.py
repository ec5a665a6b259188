"""What only a CUDA device can show: graph capture, >2^31-element tensors, mixed devices."""

from __future__ import annotations

import pytest
import torch

import trainfuse
from tests._helpers import cuda
from tests.optim.reference import assert_step_matches, snapshot


@cuda
@pytest.mark.parametrize("cls", [trainfuse.FusedAdamW, trainfuse.FusedSGD], ids=lambda c: c.__name__)
def test_step_captured_in_cuda_graph_follows_tensor_lr(cls):
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in [(300, 7), (5,), (4099,)]]
    lr = torch.tensor(0.01, device="cuda")
    opt = cls(params, lr=lr, **({"momentum": 0.9} if cls is trainfuse.FusedSGD else {}))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # builds the tables outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for new_lr in (0.02, 0.005):
        lr.fill_(new_lr)
        for p in params:
            p.grad.copy_(torch.randn_like(p))
        before = snapshot(opt)
        grads = [p.grad.clone() for p in params]
        graph.replay()
        torch.cuda.synchronize()
        assert_step_matches(opt, *before, grads, torch.float32, msg=f"replay lr={new_lr}")


@cuda
def test_tensor_over_2_to_the_31_elements():
    n = 2**31 + 4096 + 17
    free, _ = torch.cuda.mem_get_info()
    if free < 4 * n * 2 + (1 << 30):
        pytest.skip("not enough GPU memory for three bf16 tensors of 2^31 elements")
    p = torch.nn.Parameter(torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_())
    p.grad = torch.empty_like(p).normal_()
    opt = trainfuse.FusedSGD([p], lr=0.5, momentum=0.9)
    probe = torch.tensor([0, 2**31 - 1, 2**31, n - 1], device="cuda")
    expected = (p.detach()[probe].float() - 0.5 * p.grad[probe].float()).bfloat16()
    opt.step()
    torch.testing.assert_close(p.detach()[probe], expected, rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"][probe], p.grad[probe])


@cuda
def test_params_on_cpu_and_cuda_in_one_optimizer(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "auto")
    params = [torch.nn.Parameter(torch.randn(33, device=d)) for d in ("cuda", "cpu", "cuda")]
    opt = trainfuse.FusedAdamW(params, lr=0.1)
    for _ in range(2):
        before = snapshot(opt)
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        assert_step_matches(opt, *before, grads, torch.float32)


@cuda
def test_grad_scale_of_another_dtype_after_the_launch_is_cached():
    params = [torch.nn.Parameter(torch.randn(3000, device="cuda"))]
    opt = trainfuse.FusedSGD(params, lr=0.1)
    for scale in (torch.tensor(8.0, device="cuda"), torch.tensor(8.0, device="cuda", dtype=torch.float64)):
        before = snapshot(opt)
        g = torch.randn_like(params[0])
        params[0].grad = g * 8.0
        opt.grad_scale, opt.found_inf = scale, torch.zeros((), device="cuda")
        opt.step()
        del opt.grad_scale, opt.found_inf
        assert_step_matches(opt, *before, [g], torch.float32, msg=str(scale.dtype))


@cuda
def test_fused_grad_scaler_is_three_launches_for_the_ultralytics_phase():
    """GradScaler + FusedSGD(max_grad_norm) + attached FusedEMA: the optimizer phase launches the
    statistics pass, the update (EMA included) and torch's scale update, nothing else."""
    from torch.profiler import ProfilerActivity, profile

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).cuda()
    model(torch.randn(2, 3, 8, 8, device="cuda")).sum().backward()
    opt = trainfuse.FusedSGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True, max_grad_norm=10.0)
    opt.attach_ema(trainfuse.FusedEMA(model))
    scaler = trainfuse.amp.GradScaler("cuda")
    scaler.scale(torch.ones((), device="cuda"))
    for _ in range(2):  # compile and cache first
        scaler.step(opt)
        scaler.update()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name]
    # exactly: the statistics pass, the update (EMA folded in), torch's scale update
    assert len(kernels) == 3, kernels
    assert "grad_stats_kernel" in kernels[0] and "update_kernel" in kernels[1], kernels
    assert "update_scale" in kernels[2], kernels
