"""Markers and helpers shared by the test packages (import them: ``from tests._helpers import cuda``)."""

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Make any host synchronization in the block raise (torch's sync debug mode "error")."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def warm_on_side_stream(fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn`` once on a side stream and wait for it: its kernels compile and the side stream's
    workspaces exist before a CUDA-graph capture (which runs on a side stream too)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)


INF_STEPS = {1: math.inf, 3: math.nan}  # steps of a scaled run whose grads hold a non-finite value


def twin_scalers(scaler_cls, device: torch.device):
    """The scaler under test and torch's GradScaler, with the same settings (a 2**10 scale that
    grows every 2 clean steps, so a 5-step run backs off and grows)."""
    return (scaler_cls(device.type, init_scale=2.0**10, growth_interval=2),
            torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2))


def set_scaled_twin_grads(ours, theirs, sa, sb, step: int, gain: float = 1.0) -> None:
    """Step ``step``'s grads for two runs of the same params: random (times ``gain``), with an inf
    or NaN in one element on :data:`INF_STEPS`, each run's multiplied by its own scaler's scale as
    the backward of ``scaler.scale(loss)`` leaves them."""
    device = ours[0].device
    sa.scale(torch.ones((), device=device))  # what scaler.scale(loss) does first: make _scale
    sb.scale(torch.ones((), device=device))
    grads = [torch.randn_like(p) * gain for p in ours]
    if step in INF_STEPS:
        grads[2].view(-1)[5] = INF_STEPS[step]
    for p, q, g in zip(ours, theirs, grads):
        p.grad = g * sa.get_scale()
        q.grad = g * sb.get_scale()


def spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each of ``values`` (float64): ``eps * 2**e`` for a
    value in ``[2**e, 2**(e + 1))``, the subnormal step below ``dtype``'s smallest normal."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(values.detach().double().abs().nan_to_num(posinf=info.max)
                              .clamp_min(info.smallest_normal))
    return torch.ldexp(torch.full_like(values, info.eps, dtype=torch.float64), exponent - 1)


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
               atol: float | torch.Tensor = 0.0) -> torch.Tensor:
    """How far ``actual`` is from the exact ``expected`` beyond ``atol``, in units in the last place of
    ``dtype`` at ``expected`` (float64, element for element; 0 where both are the same infinity or
    both NaN, inf where only one is not finite)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}"
    off = (((a - e).abs() - atol) / spacing(e, dtype)).clamp_min(0)
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    return torch.where(same, 0.0, off.nan_to_num(nan=math.inf))


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float, dtype: torch.dtype,
                       atol: float | torch.Tensor = 0.0) -> None:
    """``|actual - expected| <= ulps * spacing(expected, dtype) + atol`` element for element:
    ``actual`` within ``ulps`` units in the last place of ``dtype`` at the exact ``expected``, plus
    ``atol`` (a number or a tensor like ``expected``) for error made before rounding to ``dtype``.
    An infinite or NaN ``expected`` must be matched exactly."""
    off = ulps_apart(actual, expected, dtype, atol)
    bad = off > ulps
    if bad.any():
        worst = int(off.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), off.shape))
        raise AssertionError(
            f"{int(bad.sum())} of {off.numel()} elements more than {ulps} {dtype} ulps (beyond atol) "
            f"apart; worst at {index}: {actual.flatten()[worst].item()!r} for "
            f"{expected.flatten()[worst].item()!r}, {off.flatten()[worst].item():.3g} ulps of "
            f"{spacing(expected.flatten()[worst], dtype).item():.3g}")


def cuda_kernel_names(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The names of the CUDA kernels (and copies) that one ``fn(*args)`` runs, after a first call
    that compiles and caches (torch.profiler, synchronized at both ends)."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def join_two_ranks(rank: int, root: str, backend: str) -> torch.device:
    """In a rank :func:`spawn_two_ranks` started: join the 2-process group (rendezvous in folder
    ``root``) and return this rank's device (the CPU under gloo, GPU ``rank`` under NCCL, made
    current)."""
    import datetime
    import faulthandler

    import torch.distributed as dist

    # a rank stuck in a collective ends the test with every thread's stack instead of hanging it
    faulthandler.dump_traceback_later(float(os.environ.get("TRAINFUSE_TEST_RANK_TIMEOUT", 300)), exit=True)
    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{root}/init", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=100))
    return device


def spawn_two_ranks(worker: Callable[..., None], root: str, backend: str, monkeypatch) -> None:
    """Run ``worker(rank, root, "gloo" or "nccl")`` in 2 processes for a test parametrized over
    ``backend``: ``torch`` (gloo, torch's path), ``triton`` (gloo, the kernels through the
    interpreter: skipped where it is off) or ``nccl`` (2 GPUs, the compiled kernels, NVLink
    multicast off: skipped with fewer). The spawned ranks inherit ``TRAINFUSE_BACKEND``."""
    import torch.multiprocessing as mp

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors reach the kernels through the interpreter only; "
                    "the 2-GPU NCCL run covers the compiled kernels")
    if backend == "nccl":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
        monkeypatch.delenv("TRAINFUSE_BACKEND", raising=False)
    else:
        monkeypatch.setenv("TRAINFUSE_BACKEND", backend)
    mp.spawn(worker, args=(root, "nccl" if backend == "nccl" else "gloo"), nprocs=2, join=True)
