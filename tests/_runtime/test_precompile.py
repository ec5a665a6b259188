"""Compiling kernels ahead (trainfuse._runtime.precompile): the manifest's entries stand for the
launches they were recorded from, manifests merge and survive bad files, and on a GPU a kernel
compiled by a worker is found in Triton's cache by a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton.language as tl

from trainfuse._runtime import compat, precompile
from trainfuse._runtime.launch import CachedLauncher
from trainfuse.losses import bce

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", [1, 0, 16, 17, -3, 2**33, 2**33 + 16, -(2**31) - 1])
def test_int_stand_in_specializes_alike(value):
    spec = precompile.arg_spec(value)
    assert precompile.arg_spec(precompile.mock_arg(spec)) == spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize("aligned", [True, False])
def test_tensor_stand_in_specializes_alike(dtype, aligned):
    t = torch.zeros(8, dtype=dtype)
    t = t if aligned else t[1:]
    spec = precompile.arg_spec(t)
    assert spec == ["tensor", str(dtype).removeprefix("torch."), aligned]
    mock = precompile.mock_arg(spec, device="cpu")
    assert mock.dtype == dtype and precompile.arg_spec(mock) == spec


def test_an_odd_constexpr_has_no_entry_an_unaligned_view_has_one():
    t = torch.zeros(64, dtype=torch.float32)
    e = precompile.entry(bce._scale_kernel, (t[1:], t, 5), 4, {"CD": tl.float32, "BLOCK": 64})
    assert e["args"][0] == ["tensor", "float32", False]
    assert precompile.entry(bce._scale_kernel, (t, t, 5), 4, {"CD": object(), "BLOCK": 64}) is None
    assert precompile.arg_spec(2.5) == ["float"]
    with pytest.raises(TypeError, match="constexpr"):
        precompile.arg_spec(True)


def test_an_int_triton_does_not_specialize_is_recorded_by_its_width_alone():
    from trainfuse.losses.detection import assigner

    t = torch.zeros(64, dtype=torch.float32)
    args = [t] * 7
    entries = [precompile.entry(assigner.resolve_kernel, (*args, 8400, m), 4, {"BLOCK": 1024})
               for m in (1, 8, 16, 17)]
    assert all(e == entries[0] for e in entries)  # the capacity: one compile serves 1, 8, 16, 17
    assert entries[0]["args"][-1] == ["int", False, False, False]
    assert entries[0]["args"][-2] == ["int", False, True, False]  # the anchors still specialize
    wide = precompile.entry(assigner.resolve_kernel, (*args, 8400, 2**33), 4, {"BLOCK": 1024})
    assert wide["args"][-1] == ["int", False, False, True]


def test_the_label_capacity_specializes_no_detection_kernel():
    # a run's capacity changes (16, then 8 once mosaic closes): each would be a compile mid-run
    from trainfuse.losses.detection import assigner, box_loss

    kernels = [assigner.metric_kernel, assigner.resolve_kernel, assigner.topk2_kernel,
               assigner.scores_kernel, box_loss.box_loss_fwd_kernel, box_loss.box_loss_bwd_kernel]
    for fn in kernels:
        assert "M" in fn.arg_names and "M" in compat.unspecialized_args(fn), fn.fn.__qualname__


def test_a_device_function_constexpr_is_named():
    from trainfuse._multi_tensor import kernels
    from trainfuse.optim import adam

    chunk_fn = next(v for v in vars(adam).values() if hasattr(v, "arg_names") and hasattr(v, "fn"))
    named = json.loads(json.dumps(precompile._const(chunk_fn)))
    assert named == {"jit": f"{chunk_fn.fn.__module__}:{chunk_fn.fn.__qualname__}"}
    assert precompile._unconst(named) is chunk_fn
    t = torch.zeros(64)
    constexprs = {"CHUNK_FN": chunk_fn, "HAS_CLIP": kernels.CLIP_NORM}
    e = precompile.entry(kernels.update_kernel, (t,), 4, constexprs)
    assert e["constexprs"] == {"CHUNK_FN": named, "HAS_CLIP": {"constexpr": 1}}


def test_a_named_constant_passed_as_a_constexpr_object_stays_one():
    """A module's ``tl.constexpr`` constant passed as a launch's constexpr (the update kernel's
    ``HAS_CLIP``) has an entry, and its stand-in passes the same object again."""
    from trainfuse._multi_tensor import kernels

    for constant in (kernels.CLIP_NONE, kernels.CLIP_NORM, kernels.CLIP_VALUE, tl.constexpr(True)):
        named = json.loads(json.dumps(precompile._const(constant)))
        assert named == {"constexpr": constant.value}
        back = precompile._unconst(named)
        assert type(back) is type(constant) and str(back) == str(constant) and back.value == constant.value
    assert precompile._const(tl.constexpr(object())) is None
    assert precompile._const(tl.constexpr(tl.float32)) is None  # not worth a JSON form yet
    t = torch.zeros(64)
    e = precompile.entry(bce._scale_kernel, (t, t, 5), 4, {"CD": tl.float32, "BLOCK": tl.constexpr(64)})
    assert e["constexprs"]["BLOCK"] == {"constexpr": 64}


def test_kernels_without_a_stand_in_are_dropped_from_manifests(tmp_path, monkeypatch):
    name = "trainfuse._multi_tensor.kernels:update_kernel"
    monkeypatch.setattr(precompile, "NO_STAND_IN", frozenset({name}))
    t = torch.zeros(64)
    assert precompile.entry(bce._scale_kernel, (t,), 4, {}) is not None
    monkeypatch.setattr(precompile, "NO_STAND_IN", frozenset({"trainfuse.losses.bce:_scale_kernel"}))
    assert precompile.entry(bce._scale_kernel, (t,), 4, {}) is None
    monkeypatch.setattr(precompile, "NO_STAND_IN", frozenset({name}))
    path = tmp_path / "m.json"
    precompile.save(path, [{"fn": name, "args": [], "num_warps": 4, "constexprs": {}},
                           {"fn": "trainfuse.losses.bce:_scale_kernel", "args": [], "num_warps": 4,
                            "constexprs": {}}])
    assert [e["fn"] for e in precompile.load(path)] == ["trainfuse.losses.bce:_scale_kernel"]


def test_entry_names_the_kernel_and_round_trips_through_json():
    t = torch.zeros(64, dtype=torch.float32)
    e = precompile.entry(bce._scale_kernel, (t, t, 64), 4, {"CD": tl.float64, "BLOCK": 256})
    e = json.loads(json.dumps(e))
    assert e["fn"] == "trainfuse.losses.bce:_scale_kernel"
    assert precompile.resolve(e) is bce._scale_kernel
    tensor = ["tensor", "float32", True]
    assert e["args"] == [tensor, tensor, ["int", False, True, False]]
    assert precompile._unconst(e["constexprs"]["CD"]) == tl.float64
    assert e["constexprs"]["BLOCK"] == 256 and e["num_warps"] == 4


def test_manifests_merge_dedupe_and_ignore_bad_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompile, "_SHIPPED", tmp_path / "shipped")
    a = {"fn": "m:a", "args": [], "num_warps": 4, "constexprs": {}}
    b = {"fn": "m:b", "args": [["float"]], "num_warps": 8, "constexprs": {"X": 1}}
    precompile.save(tmp_path / "shipped" / "demo.json", [a, b])
    monkeypatch.setattr(precompile, "_recorded", {})
    assert precompile.remember("demo") is None  # nothing recorded
    precompile._recorded[json.dumps(b, sort_keys=True)] = b
    c = {"fn": "m:c", "args": [], "num_warps": 4, "constexprs": {}}
    precompile._recorded[json.dumps(c, sort_keys=True)] = c
    path = precompile.remember("demo")
    assert path is not None and path.parent == tmp_path
    assert precompile.manifest("demo") == [a, b, c]
    path.write_text("{ not json")
    assert precompile.manifest("demo") == [a, b]
    path.write_text(json.dumps({"version": precompile.VERSION + 1, "entries": [c]}))
    assert precompile.load(path) == []
    assert precompile.load(tmp_path / "absent.json") == []


def test_a_clients_optional_parts_add_their_shipped_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompile, "_SHIPPED", tmp_path / "shipped")
    a = {"fn": "m:a", "args": [], "num_warps": 4, "constexprs": {}}
    b = {"fn": "m:b", "args": [], "num_warps": 4, "constexprs": {}}
    precompile.save(tmp_path / "shipped" / "demo.json", [a])
    precompile.save(tmp_path / "shipped" / "demo-part.json", [a, b])
    assert precompile.manifest("demo") == [a]
    assert precompile.manifest("demo", also=("demo-part",)) == [a, b]  # each entry once
    assert precompile.manifest("demo", also=("absent",)) == [a]


def test_dry_launches_record_each_specialization_once_and_run_nothing(kernels, device):
    from trainfuse._runtime.launch import dry_launches
    from trainfuse.nn.bn_silu import batch_norm_silu

    x = torch.randn(2, 16, 4, 4, device=device).contiguous(memory_format=torch.channels_last)
    zeros, ones = torch.zeros(16, device=device), torch.ones(16, device=device)
    running = zeros.clone(), ones.clone()
    with dry_launches() as entries:
        for _ in range(2):
            batch_norm_silu(x, *running, ones, zeros, True, 0.1, 1e-3)
    names = [e["fn"].rsplit(":", 1)[1] for e in entries]
    assert names == ["bn_stats_kernel", "bn_silu_apply_kernel"]  # the second call's are the same
    assert torch.equal(running[0], zeros) and torch.equal(running[1], ones)  # not run
    y = batch_norm_silu(x, *running, ones, zeros, True, 0.1, 1e-3)  # outside: runs
    assert not torch.equal(running[0], zeros) and torch.isfinite(y).all()


def test_a_cache_folder_that_cannot_be_written_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_PRECOMPILE", "1")
    monkeypatch.setattr(precompile.torch.cuda, "is_available", lambda: True)
    import trainfuse._runtime.backend as backend

    monkeypatch.setattr(backend, "interpreting", lambda: False)
    monkeypatch.setattr(precompile, "_SHIPPED", tmp_path / "shipped")
    entry = {"fn": "m:k", "args": [], "num_warps": 4, "constexprs": {}}
    precompile.save(tmp_path / "shipped" / "t.json", [entry])
    started = []
    monkeypatch.setattr(precompile, "_start", lambda entries, workers: started.append(entries) or "started")
    assert precompile.ahead("t") == "started" and started == [[entry]]  # what the refusal below stands on

    def unwritable(entries, workers):
        raise PermissionError(13, "Permission denied", str(tmp_path / "readonly"))

    monkeypatch.setattr(precompile, "_start", unwritable)
    assert precompile.ahead("t") is None


def test_nothing_starts_where_it_is_off_or_without_cuda(monkeypatch):
    monkeypatch.setenv("TRAINFUSE_PRECOMPILE", "0")
    assert precompile.ahead("ultralytics") is None
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRAINFUSE_PRECOMPILE", "1")
        assert precompile.ahead("ultralytics") is None


def test_worker_counts_entries_it_could_not_compile_and_lists_none_of_them(tmp_path):
    path, done = tmp_path / "m.json", tmp_path / "done.txt"
    precompile.save(path, [{"fn": "trainfuse.no_such_module:kernel", "args": [], "num_warps": 4,
                            "constexprs": {}}])
    assert precompile.main([str(path), "0", "1", str(done)]) == 1
    assert not done.exists()
    ((kernel, error),) = precompile.worker_failures(done)  # the reason is kept for the run's log
    assert kernel == "trainfuse.no_such_module:kernel" and error.startswith("ModuleNotFoundError")
    # (first launches of kernels by earlier tests in this process are not this line's)
    line = precompile.summary(since=len(precompile.first_launches()), failures=[(kernel, error)])
    assert line == f"the compile workers failed on 1 (first: {kernel}: {error})"
    assert precompile.main([str(path), "1", "2"]) == 0  # claimed by worker 0 already: left alone


def test_workers_each_compile_what_no_other_claimed(tmp_path):
    """Worker i starts at entry i, then takes what is left after it, wrapping around: every entry
    once over all workers, however many there are and in whatever order they run."""
    entries = [{"fn": f"trainfuse.no_such_module:kernel{i}", "args": [], "num_warps": 4, "constexprs": {}}
               for i in range(5)]
    for count, order in ((1, [0]), (2, [1, 0]), (3, [0, 1, 2]), (8, [7, 2, 0, 1, 3, 4, 5, 6])):
        path, done = tmp_path / f"m{count}.json", tmp_path / f"done{count}.txt"
        precompile.save(path, entries)
        failed = [precompile.main([str(path), str(i), str(count), str(done)]) for i in order]
        assert failed == [5] + [0] * (count - 1)  # one after the other: the first takes them all
        names = [k for k, _ in precompile.worker_failures(done)]
        start = min(order[0], 5)
        assert names == [entries[k]["fn"] for k in [*range(start, 5), *range(start)]]
    # at once: each entry once, the first ones in the workers' own order
    path, done = tmp_path / "m.json", tmp_path / "done.txt"
    precompile.save(path, entries)
    command = [sys.executable, "-c", precompile._WORKER, str(path)]  # as ahead() starts them
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [subprocess.Popen([*command, str(i), "3", str(done)], env=env, cwd=ROOT) for i in range(3)]
    assert sum(w.wait(timeout=300) for w in workers) == 5
    assert sorted(k for k, _ in precompile.worker_failures(done)) == sorted(e["fn"] for e in entries)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the priority from /proc")
def test_a_worker_runs_below_the_runs_priority(tmp_path):
    path = tmp_path / "m.json"
    precompile.save(path, [])
    worker = subprocess.Popen([sys.executable, "-c", precompile._WORKER, str(path), "0", "1"],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    seen = set()
    while worker.poll() is None and 10 not in seen:  # its imports take a second or more
        try:
            stat = Path(f"/proc/{worker.pid}/stat").read_text()
        except OSError:
            break
        seen.add(int(stat.rpartition(")")[2].split()[16]) - os.nice(0))  # field 19: nice
        time.sleep(0.005)
    worker.kill()  # what it runs is the workers' test above: it starts them with this command
    worker.wait(timeout=60)
    assert 10 in seen


def test_a_launch_waits_for_the_worker_compiling_it_and_no_longer(tmp_path, monkeypatch):
    done = tmp_path / "done.txt"
    t = torch.zeros(64)
    mine = precompile.entry(bce._scale_kernel, (t, t, 64), 4, {"CD": tl.float32, "BLOCK": 64})
    other = precompile.entry(bce._scale_kernel, (t, t, 65), 4, {"CD": tl.float32, "BLOCK": 64})
    text = json.dumps(mine, sort_keys=True)
    ahead = precompile.Ahead(2, 0, [text, json.dumps(other, sort_keys=True)], done)
    # a "worker" that lists the entry after a moment, then lingers
    worker = ("import sys, time; time.sleep(0.3); open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); "
              "time.sleep(30)")
    ahead.processes.append(subprocess.Popen([sys.executable, "-c", worker, str(done), text]))
    monkeypatch.setattr(precompile, "_active", ahead)
    monkeypatch.setattr(precompile, "_recorded", {})
    try:
        precompile.launching(bce._scale_kernel, (t, t, 64), 4, {"CD": tl.float32, "BLOCK": 64})
        assert 0.2 < ahead.waited < 20 and text not in ahead.pending
        assert ahead.waits == {"_scale_kernel": ahead.waited}
        assert precompile.recorded() == [mine]
        waited = ahead.waited
        precompile.launching(bce._scale_kernel, (t, t, 64), 4, {"CD": tl.float32, "BLOCK": 64})
        assert ahead.waited == waited  # compiled: no second wait
    finally:
        ahead.stop()
    assert precompile._active is None and all(p.poll() is not None for p in ahead.processes)
    precompile.launching(bce._scale_kernel, (t, t, 65), 4, {"CD": tl.float32, "BLOCK": 64})  # no workers


def test_first_launches_are_timed_once_and_summarized(monkeypatch):
    monkeypatch.setattr(precompile, "_recorded", {})
    monkeypatch.setattr(precompile, "_first", [])
    monkeypatch.setattr(precompile, "_unrecordable", set())
    t = torch.zeros(64)
    assert precompile.summary() is None
    with precompile.first_launch(bce._scale_kernel, (t, t, 64), 4, {"CD": tl.float32, "BLOCK": 64}):
        time.sleep(0.05)
    with precompile.first_launch(bce._scale_kernel, (t, t, 64), 4, {"CD": tl.float32, "BLOCK": 64}):
        pass  # the same specialization: not a first launch
    (name, seconds), = precompile.first_launches()
    assert name == "_scale_kernel" and 0.04 < seconds < 5
    # a bool argument has no stand-in in a manifest: timed, and named as not compiled ahead
    with precompile.first_launch(bce._scale_kernel, (t, t, True), 4, {"CD": tl.float32, "BLOCK": 64}):
        pass
    assert precompile.unrecordable() == ["trainfuse.losses.bce:_scale_kernel"]
    assert len(precompile.first_launches()) == 2 and len(precompile.recorded()) == 1
    line = precompile.summary(waited=1.25)
    assert line.startswith("2 kernel specializations first launched in ") and "_scale_kernel" in line
    assert "launches waited 1.2 s for the compile workers;" in line
    line = precompile.summary(waited=1.25, waits={"update_kernel": 0.9, "a": 0.3, "b": 0.04, "c": 0.01})
    assert "launches waited 1.2 s for the compile workers (update_kernel 0.9 s, a 0.3 s);" in line
    assert "no manifest entry): trainfuse.losses" in line
    assert precompile.summary(since=2) is None


def test_shipped_manifests_name_kernels_that_exist():
    for path in sorted(precompile._SHIPPED.glob("*.json")):
        entries = precompile.load(path)
        assert entries, f"{path.name} holds no entries of version {precompile.VERSION}"
        for e in entries:
            fn = precompile.resolve(e)
            assert hasattr(fn, "fn"), f"{e['fn']} is not a Triton JIT function"
            names = fn.arg_names
            assert set(e["constexprs"]) <= set(names), e["fn"]
            # every parameter named: the cached launcher passes a kernel's constexprs by name, and
            # a constexpr left to its default would be missing there (launches name them all)
            assert len(e["args"]) + len(e["constexprs"]) == len(names), e["fn"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling ahead needs CUDA")
def test_launcher_records_and_a_worker_compiles_for_a_fresh_process(tmp_path, monkeypatch):
    monkeypatch.setattr(precompile, "_recorded", {})
    launcher = CachedLauncher()
    g = torch.ones(1000, device="cuda")
    go = torch.full((), 2.0, device="cuda")
    launcher(bce._scale_kernel, (4,), g, go, g.numel(), CD=tl.float32, BLOCK=128, num_warps=4)
    torch.testing.assert_close(g, torch.full_like(g, 2.0))
    odd = torch.ones(1001, device="cuda")[1:]  # a view off 16-byte alignment: another specialization
    launcher(bce._scale_kernel, (4,), odd, go, odd.numel(), CD=tl.float32, BLOCK=128, num_warps=4)
    entries = precompile.recorded()
    assert [e["fn"] for e in entries] == ["trainfuse.losses.bce:_scale_kernel"] * 2
    assert [e["args"][0][2] for e in entries] == [True, False]
    manifest = tmp_path / "m.json"
    precompile.save(manifest, entries)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "trainfuse._runtime.precompile", str(manifest), "0", "1"],
                   env=env, check=True, cwd=ROOT, timeout=300)
    cached = sorted(p.name for p in (tmp_path / "triton").iterdir())
    assert cached, "the worker compiled nothing into the cache"
    launch = ("import torch, triton.language as tl; from trainfuse.losses import bce; "
              "g = torch.ones(1000, device='cuda'); go = torch.full((), 2.0, device='cuda'); "
              "odd = torch.ones(1001, device='cuda')[1:]; "
              "bce._scale_kernel[(4,)](g, go, g.numel(), CD=tl.float32, BLOCK=128, num_warps=4); "
              "bce._scale_kernel[(4,)](odd, go, odd.numel(), CD=tl.float32, BLOCK=128, num_warps=4); "
              "torch.cuda.synchronize(); assert g.eq(2).all() and odd.eq(2).all()")
    subprocess.run([sys.executable, "-c", launch], env=env, check=True, cwd=ROOT, timeout=300)
    assert sorted(p.name for p in (tmp_path / "triton").iterdir()) == cached, \
        "the fresh process compiled again: the worker's specialization differs from the launch's"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling ahead needs CUDA")
def test_ahead_compiles_once_per_cache_then_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFUSE_PRECOMPILE", "1")
    monkeypatch.setenv("TRAINFUSE_CACHE_DIR", str(tmp_path / "trainfuse"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr(precompile, "_SHIPPED", tmp_path / "shipped")
    t = torch.zeros(64, device="cuda")
    e = precompile.entry(bce._scale_kernel, (t, t, 48), 4, {"CD": tl.float32, "BLOCK": 64})
    precompile.save(tmp_path / "shipped" / "t.json", [e])
    first = precompile.ahead("t", workers=1)
    try:
        assert first.workers == 1 and first.compiled_before == 0
        first.wait_for(json.dumps(e, sort_keys=True), timeout=300)
        assert first.waited > 0
    finally:
        first.stop()
    listed = [json.loads(line) for line in precompile._done_log().read_text().splitlines()]
    assert listed == [e]
    if precompile._triton_cache().is_dir() and any(precompile._triton_cache().iterdir()):
        second = precompile.ahead("t", workers=1)
        assert second.workers == 0 and second.compiled_before == 1


# Triton's cache key of each compile, in parts, appended to $KEY_LOG (the processes below run it
# first): which part differs where a stand-in misses the launch's cache entry
_KEY_LOG = """
import json, os, triton.compiler.compiler as _c
_key = _c.get_cache_key
def _logged(src, backend, options, env_vars):
    fn = src.fn
    consts = {str(k): getattr(v, "cache_key", None) or str(v) for k, v in sorted(src.constants.items())}
    parts = {"fn": fn.cache_key, "attrs": str(src.attrs), "constants": consts, "backend": backend.hash(),
             "signature": str([v for _, v in sorted(src.signature.items())]), "options": options.hash(),
             "env": str(sorted(env_vars.items()))}
    with open(os.environ["KEY_LOG"], "a") as f:
        f.write(json.dumps({"name": fn.fn.__qualname__, "parts": parts}) + "\\n")
    return _key(src, backend, options, env_vars)
_c.get_cache_key = _logged
"""
_STEP = """
import torch, trainfuse
torch.manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (1000, 4096, 17)]
opt = trainfuse.FusedSGD(ps, lr=0.01, momentum=0.9, nesterov=True, max_grad_norm=10.0)
for p in ps:
    p.grad = torch.randn_like(p)
opt.step()
torch.cuda.synchronize()
"""


def _keys(path: Path) -> dict[str, list[dict]]:
    keys: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        keys.setdefault(record["name"], []).append(record["parts"])
    return keys


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling ahead needs CUDA")
def test_stand_ins_of_an_optimizer_step_hit_its_cache_entries_but_for_no_stand_in_kernels(
        tmp_path, monkeypatch):
    """The kernels of a FusedSGD step with clipping, each recorded, compiled from its entry by a
    worker, then launched by a fresh process: each finds the worker's cache entry (the same
    Triton key, part for part), but those of NO_STAND_IN, which must still miss (else they belong
    back in the manifests); the differing parts are printed (``pytest -rP``)."""
    no_stand_in = precompile.NO_STAND_IN
    monkeypatch.setattr(precompile, "_recorded", {})
    monkeypatch.setattr(precompile, "NO_STAND_IN", frozenset())  # record every kernel
    exec(compile(_STEP, "step", "exec"), {})
    entries = precompile.recorded()
    names = {e["fn"] for e in entries}
    assert "trainfuse._multi_tensor.kernels:update_kernel" in names
    (tmp_path / "entries.json").write_text(json.dumps(entries))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": str(ROOT)}
    compile_all = ("import json, sys; from trainfuse._runtime import precompile\n"
                   f"for e in json.load(open({str(tmp_path / 'entries.json')!r})):\n"
                   "    precompile.compile_entry(e)\n")
    for log, code in (("worker", compile_all), ("launch", _STEP)):
        subprocess.run([sys.executable, "-c", _KEY_LOG + code], env={**env, "KEY_LOG": str(tmp_path / log)},
                       check=True, cwd=ROOT, timeout=600)
    worker, launch = _keys(tmp_path / "worker"), _keys(tmp_path / "launch")
    for name in sorted(names):
        qualname = name.partition(":")[2]
        assert launch.get(qualname), f"{name}: the fresh process compiled nothing of it"
        for parts in launch[qualname]:
            hit = parts in worker.get(qualname, [])
            if not hit:
                nearest = min(worker.get(qualname, [{}]),
                              key=lambda w, parts=parts: sum(w.get(k) != v for k, v in parts.items()))
                differ = {k: [nearest.get(k), v] for k, v in parts.items() if nearest.get(k) != v}
                print(f"{name}: the stand-in's key (first) differs from the launch's in {json.dumps(differ)}")
            listed = name in no_stand_in
            verdict = f"{'hits' if hit else 'misses'} the launch's cache entry"
            assert hit != listed, f"{name}: {verdict}, NO_STAND_IN {'lists' if listed else 'omits'} it"
