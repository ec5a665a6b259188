"""How many Triton kernels the fused blocks compile for a model, and the shipped manifest that
compiles them ahead (trainfuse.ultralytics.block_kernels): each distinct specialization of a
launch (its constexprs, and what Triton specializes the arguments on: dtypes, 16-byte alignment,
integers equal to 1 or divisible by 16) compiles once on a machine's first run, one to two seconds
apiece for the BatchNorm kernels. The kernels leave their bookkeeping integers (channel blocks,
tiles, programs, counts) unspecialized, so that the layers of a model share their kernels. The
step is YOLO11s's at 640 px and batch 16, run on the meta device with the launches recorded
instead of run."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import pytest

from trainfuse.ultralytics.offline import offline_env

offline_env(Path(tempfile.gettempdir()) / "trainfuse-tests-yolo-config")
pytest.importorskip("ultralytics")

from trainfuse._runtime import precompile  # noqa: E402
from trainfuse.ultralytics import block_kernels  # noqa: E402
from trainfuse.ultralytics.changes import blocks  # noqa: E402


def _per_kernel(entries: list[dict]) -> collections.Counter:
    return collections.Counter(e["fn"].rsplit(":", 1)[1] for e in entries)


def test_a_models_fused_blocks_compile_a_few_kernels_each():
    per_kernel = _per_kernel(block_kernels.step_entries("yolo11s.yaml", backwards=1))
    # measured: the statistics 3, apply 4, grad sums 5, dx 4, and their forms writing into a
    # concatenation 7, 4 and 7 (which of a branch's grads they add, where its output goes): 34
    # BatchNorm kernels, where specializing the bookkeeping integers made 63
    bound = {"bn_stats_kernel": 4, "bn_silu_apply_kernel": 5, "bn_silu_grad_sums_kernel": 6,
             "bn_silu_dx_kernel": 5, "into_apply_kernel": 8, "into_grad_sums_kernel": 5, "into_dx_kernel": 8}
    assert set(bound) <= set(per_kernel), dict(per_kernel)
    over = {k: n for k, n in per_kernel.items() if n > bound.get(k, 2)}
    assert not over, f"kernel specializations: {dict(per_kernel)}"
    assert sum(per_kernel[k] for k in bound) <= 40, dict(per_kernel)


def test_the_shipped_manifest_holds_a_default_models_step():
    """Every specialization of YOLO11s's step (the grads assigned, then accumulated) is in the
    shipped manifest: a kernel change that moves them needs ``python -m
    trainfuse.ultralytics.block_kernels`` again."""
    folder = Path(precompile.__file__).with_name("manifests")
    shipped = precompile.load(folder / f"{block_kernels.MANIFEST}.json")
    step = block_kernels.step_entries("yolo11s.yaml")
    missing = [e for e in step if e not in shipped]
    assert not missing, f"{len(missing)} of {len(step)} not shipped, first: {missing[0]}"
    assert _per_kernel(step)["bn_silu_grad_sums_kernel"] > _per_kernel(
        block_kernels.step_entries("yolo11s.yaml", backwards=1))["bn_silu_grad_sums_kernel"]  # ADD too


@pytest.mark.parametrize(("setting", "task", "model", "world_size", "fused"), [
    (None, "detect", "yolo11s.yaml", 1, True), (None, "detect", "yolov8m.pt", 1, True),
    (None, "detect", "yolo11n.yaml", 1, False), (None, "detect", "custom.yaml", 1, False),
    (None, "segment", "yolo11s-seg.yaml", 1, False), (None, "detect", "yolo11s.yaml", 2, False),
    (True, "pose", "yolo11n-pose.yaml", 2, True), (False, "detect", "yolo11x.yaml", 1, False),
])
def test_the_trainer_guesses_before_building_the_model_whether_it_fuses(setting, task, model, world_size,
                                                                         fused):
    assert blocks.likely_fused(setting, task, model, world_size) is fused
