"""How many Triton kernels the fused blocks compile for a model: each distinct specialization of a
launch (its constexprs, and what Triton specializes the arguments on: dtypes, 16-byte alignment,
integers equal to 1 or divisible by 16) compiles once on a machine's first run, one to two seconds
apiece for the BatchNorm kernels, inside the first iterations. The kernels leave their bookkeeping
integers (channel blocks, tiles, programs, counts) unspecialized, so that the layers of a model
share their kernels; this counts the specializations of YOLO11s's fused step at ultralytics'
640 px and batch 16, run on the meta device with the launches recorded instead of run (the shapes
and strides of a real step: torch's meta convolutions, their outputs in channels_last as cuDNN
keeps them)."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import pytest
import torch

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from ultralytics.nn.tasks import DetectionModel  # noqa: E402

from trainfuse._runtime import compat, launch  # noqa: E402
from trainfuse.ultralytics.changes import blocks, upsample  # noqa: E402


def _key(fn, args: tuple, num_warps: int, constexprs: dict) -> tuple:
    """What Triton compiles a launch for (the meta device has no addresses: a tensor's alignment
    is its offset's, its storage being aligned as the caching allocator's blocks are)."""
    free = compat.unspecialized_args(fn)
    spec = []
    for a, name in zip(args, fn.arg_names):
        if isinstance(a, torch.Tensor):
            spec.append((a.dtype, a.storage_offset() * a.element_size() % 16 == 0))
        elif isinstance(a, int) and name not in free:
            spec.append((a == 1, a % 16 == 0))
    return fn.__name__, num_warps, tuple(spec), tuple(sorted(constexprs.items()))


def test_a_models_fused_blocks_compile_a_few_kernels_each(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the meta device takes the kernels' path
    launches = collections.Counter()

    def record(self, fn, grid, *args, num_warps, key=None, stream=None, **constexprs):
        launches[_key(fn, args, num_warps, constexprs)] += 1

    monkeypatch.setattr(launch.CachedLauncher, "__call__", record)
    model = DetectionModel("yolo11s.yaml", nc=80, verbose=False).train()
    fused, _ = blocks.fuse_model(model, True)
    upsample.install(model)
    model = model.to("meta").to(memory_format=torch.channels_last)
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.half()  # AMP's float16 convolutions (trainfuse's casts), BatchNorm in float32
            m.register_forward_hook(lambda mod, i, out: out.contiguous(memory_format=torch.channels_last))
    x = torch.empty(16, 3, 640, 640, device="meta", dtype=torch.float16)
    out = model(x.contiguous(memory_format=torch.channels_last))
    sum(o.float().sum() for o in out.values() if isinstance(o, torch.Tensor)).backward()
    per_kernel = collections.Counter(k[0] for k in launches)
    assert sum(launches.values()) >= 4 * len(fused)  # each block: two launches forward, two backward
    # measured: the statistics 3, apply 4, grad sums 5, dx 4, and their forms writing into a
    # concatenation 7, 4 and 7 (which of a branch's grads they add, where its output goes): 34
    # BatchNorm kernels, where specializing the bookkeeping integers made 63
    bound = {"bn_stats_kernel": 4, "bn_silu_apply_kernel": 5, "bn_silu_grad_sums_kernel": 6,
             "bn_silu_dx_kernel": 5, "into_apply_kernel": 8, "into_grad_sums_kernel": 5, "into_dx_kernel": 8}
    over = {k: n for k, n in per_kernel.items() if n > bound.get(k, 2)}
    assert not over, f"kernel specializations: {dict(per_kernel)}"
    assert sum(per_kernel[k] for k in bound) <= 40, dict(per_kernel)
