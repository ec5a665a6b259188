"""trainfuse._runtime.cross_compile: kernels the interpreter ran, compiled for a GPU on a machine
without one; a kernel the interpreter runs and the GPU compiler refuses is reported."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests import _kernel_record

ROOT = Path(__file__).resolve().parents[2]

# kernels the interpreter runs alike: the second calls a plain Python function, which the
# interpreter executes and Triton's code generator refuses; the third compiles to more shared
# memory than a Hopper block may have
PROBE = textwrap.dedent('''
    import triton
    import triton.language as tl


    def twice(x):
        return x * 2


    @triton.jit
    def scale(X, n, factor, BLOCK: tl.constexpr, DOUBLE: tl.constexpr = False):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + i, mask=i < n)
        y = x * factor
        if DOUBLE:
            y = y + y
        tl.store(X + i, y, mask=i < n)


    @triton.jit
    def scale_by_python(X, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(X + i, twice(tl.load(X + i, mask=i < n)), mask=i < n)


    @triton.jit
    def big_dot(A, B, C, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        i = tl.arange(0, BM)[:, None]
        j = tl.arange(0, BN)[None, :]
        k = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            acc += tl.dot(tl.load(A + i * K + (k0 + k)[None, :]), tl.load(B + (k0 + k)[:, None] * BN + j))
        tl.store(C + i * BN + j, acc)
''')


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="records the Triton interpreter's launches")
def test_interpreted_launches_compile_for_sm90_and_the_refused_kernels_are_named(tmp_path):
    if os.environ.get("TRAINFUSE_KERNEL_MANIFEST"):
        pytest.skip("this session records every launch already (TRAINFUSE_KERNEL_MANIFEST)")
    (tmp_path / "probe_kernels.py").write_text(PROBE)
    sys.path.insert(0, str(tmp_path))
    stop = _kernel_record.install()
    try:
        import probe_kernels

        x = torch.arange(100, dtype=torch.float32)
        probe_kernels.scale[(2,)](x, 100, 0.5, BLOCK=64)
        probe_kernels.scale[(2,)](x, 100, 0.5, BLOCK=64)  # the same specialization: one entry
        half = x.to(torch.float16)
        probe_kernels.scale[(1,)](half[1:], 99, 2.0, BLOCK=128, DOUBLE=True, num_warps=2)
        probe_kernels.scale_by_python[(2,)](x, 100, BLOCK=64)
        a, b = torch.randn(256, 128), torch.randn(128, 256)
        c = torch.empty(256, 256)
        probe_kernels.big_dot[(1,)](a, b, c, 128, BM=256, BN=256, BK=128, num_warps=8)
    finally:
        stop()
        sys.path.remove(str(tmp_path))
        sys.modules.pop("probe_kernels", None)
    assert torch.equal(x, torch.arange(100, dtype=torch.float32) * 0.5)  # halved twice, then doubled
    manifest = _kernel_record.save(tmp_path / "manifest", "probe")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = subprocess.run([sys.executable, "-m", "trainfuse._runtime.cross_compile", str(manifest.parent),
                           "--arch", "90"], env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "2 of 4 specializations of 3 kernels compiled for sm_90" in out, out
    assert re.search(r"^  scale: 2, \d+, \d+, 0$", out, re.M), out  # registers and no spills, from the cubin
    failed = sorted(line for line in out.splitlines() if line.startswith("FAILED"))
    assert len(failed) == 2, out
    assert "probe_kernels:big_dot" in failed[0] and "probe_kernels:scale_by_python" in failed[1], out
    assert "bytes of shared memory, sm_90 allows 232448" in out, out  # would not launch on an H200


def test_interpreter_only_constexprs_compile_with_the_gpus_values():
    """An entry recorded under the interpreter names the interpreter's emulations (RNE, UPCAST)
    and its own block sizes: compiled for a GPU, it takes what a GPU launch passes."""
    from trainfuse._runtime.cross_compile import as_on_gpu
    from trainfuse.ultralytics.augment.kernel import GPU_BLOCK, INTERPRETER_BLOCK

    e = {"fn": "trainfuse.ultralytics.augment.kernel:_augment_kernel", "args": [], "num_warps": 4,
         "constexprs": {"BLOCK": INTERPRETER_BLOCK, "HSV": True}}
    assert as_on_gpu(e)["constexprs"] == {"BLOCK": GPU_BLOCK, "HSV": True}
    e = {"fn": "trainfuse.optim.newton_schulz:_gather", "args": [], "num_warps": 4,
         "constexprs": {"RNE": True, "TILE": 64}}
    assert as_on_gpu(e)["constexprs"] == {"RNE": False, "TILE": 64}
    assert e["constexprs"]["RNE"] is True  # the recorded entry is left as it was


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="records the Triton interpreter's launches")
def test_the_default_runs_kernels_and_the_fused_blocks_compile_for_sm90(tmp_path, monkeypatch):
    """What a GPU would compile, compiled here: the shipped manifest (the kernels of ultralytics'
    default run), the BatchNorm-SiLU kernels at the tiles a GPU launches them with (the layout's
    own, not the tests' shrunk ones), the concatenation's op, SPPF's poolings and the neck's
    upsampling into its concatenation included, and the
    optimizers' update at its default launch shape (AdamW on float32 and bfloat16 params, MuSGD's
    Newton-Schulz)."""
    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")  # the kernels, at their default shapes
    import shutil

    from trainfuse._runtime import precompile
    from trainfuse.nn.bn_silu import batch_norm_silu, split_batch_norm_silu
    from trainfuse.nn.bn_silu_into import batch_norm_silu_into
    from trainfuse.nn.concat import ConcatBuffer
    from trainfuse.nn.pool_chain import max_pool_chain
    from trainfuse.nn.upsample_concat import upsample_concat

    if os.environ.get("TRAINFUSE_KERNEL_MANIFEST"):
        pytest.skip("this session records every launch already (TRAINFUSE_KERNEL_MANIFEST)")
    folder = tmp_path / "manifest"
    folder.mkdir()
    shipped = Path(precompile.__file__).with_name("manifests") / "ultralytics.json"
    shutil.copy(shipped, folder / "shipped.json")
    stop = _kernel_record.install()
    try:
        for C, side in ((64, 8), (48, 5)):  # whole tiles, and masked ones
            cl = torch.channels_last
            x = torch.randn(2, C, side, side, dtype=torch.float16).contiguous(memory_format=cl)
            x.requires_grad_()
            w, b = torch.ones(C, requires_grad=True), torch.zeros(C, requires_grad=True)
            rm, rv = torch.zeros(C), torch.ones(C)
            g = torch.randn(2, 2 * C, side, side).contiguous(memory_format=cl)
            (batch_norm_silu(x, rm, rv, w, b, True).float() * g[:, :C]).sum().backward()
            (split_batch_norm_silu(x, rm, rv, w, b, True)[1].float() * g[:, C // 2:C]).sum().backward()
            buffer = ConcatBuffer(2 * C)
            s0, d0 = batch_norm_silu_into(x, rm, rv, w, b, True, 0.1, 1e-5, buffer, C // 2)
            r = d0.repeat(1, 2, 1, 1)  # a shortcut with a grad
            s1, d1 = batch_norm_silu_into(x, rm, rv, w, b, True, 0.1, 1e-5, buffer, 0, residual=r)
            ((buffer.join(s0, s1).float() * g).sum() + d1.float().sum()).backward()
        # SPPF's poolings at the tile of its GPU sizes (32 channels a program, k 5, three levels)
        y = torch.randn(2, 48, 5, 5, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        pooled = max_pool_chain(y.requires_grad_(), 5, 3)
        pooled.backward(torch.randn_like(pooled))
        # a neck's upsampling into its concatenation (64 channels a program)
        a = torch.randn(2, 128, 3, 3, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        b = torch.randn(2, 64, 6, 6, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        joined = upsample_concat(a.requires_grad_(), b)
        joined.backward(torch.randn_like(joined))
        from trainfuse.optim import FusedAdamW, FusedMuSGD

        for dtype in (torch.float32, torch.bfloat16):
            params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in ((64, 48), (80,))]
            for p in params:
                p.grad = torch.randn_like(p)
            FusedAdamW(params, lr=1e-3, weight_decay=0.1).step()
        params = [torch.nn.Parameter(torch.randn(s)) for s in ((64, 48), (80,))]
        for p in params:
            p.grad = torch.randn_like(p)
        FusedMuSGD([{"params": params[:1], "use_muon": True}, {"params": params[1:], "use_muon": False}],
                   lr=0.01, momentum=0.9).step()
    finally:
        stop()
    _kernel_record.save(folder, "blocks")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "trainfuse._runtime.cross_compile", str(folder), "--arch",
                           "90", "--jobs", "2"], env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    names = ("bn_stats_kernel", "bn_silu_apply_kernel", "bn_silu_grad_sums_kernel", "bn_silu_dx_kernel",
             "into_apply_kernel", "into_grad_sums_kernel", "into_dx_kernel", "update_kernel", "_gather",
             "_scatter", "pool_chain_fwd_kernel", "pool_chain_bwd_kernel", "up_concat_fwd_kernel",
             "up_concat_bwd_kernel")
    assert all(f"  {n}: " in out for n in names), out
