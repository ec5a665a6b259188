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

# two kernels the interpreter runs alike; the second calls a plain Python function, which the
# interpreter executes and Triton's code generator refuses
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
''')


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="records the Triton interpreter's launches")
def test_interpreted_launches_compile_for_sm90_and_a_refused_kernel_is_named(tmp_path):
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
    assert done.returncode == 1, out
    assert "2 of 3 specializations of 2 kernels compiled for sm_90" in out, out
    assert re.search(r"^  scale: 2, \d+, \d+, 0$", out, re.M), out  # registers and no spills, from the cubin
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "probe_kernels:scale_by_python" in failed[0], out


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
