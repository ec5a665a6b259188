"""What the trainer logs of the kernels compiled ahead, and that nothing starts off CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("ultralytics")

from trainfuse._runtime import precompile  # noqa: E402
from trainfuse.ultralytics import warm_start  # noqa: E402


def test_nothing_is_compiled_ahead_for_a_cpu_run():
    kernels = warm_start.KernelsAhead(torch.device("cpu"))
    assert kernels.started() is None and kernels.finished() is None


def test_the_log_says_what_was_compiled_before_and_what_the_workers_compile(tmp_path, monkeypatch):
    ahead = precompile.Ahead(5, 2, ["a", "b", "c"], tmp_path / "done.txt")
    ahead.processes.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))
    monkeypatch.setattr(warm_start.precompile, "ahead", lambda name, also=(): ahead)
    kernels = warm_start.KernelsAhead(torch.device("cuda", 0))
    try:
        assert kernels.started() == ("5 kernel specializations: 2 compiled on an earlier run, 3 compiling in "
                                     "1 processes (a launch waits for its own)")
        ahead.waited = 1.25
        assert kernels.finished() == "launches waited 1.2 s for the compile workers"
    finally:
        ahead.stop()
    assert ahead.processes[0].poll() is not None and kernels.finished() is None


def test_a_warm_machine_starts_no_worker_and_says_so(tmp_path, monkeypatch):
    warm = precompile.Ahead(4, 4, [], tmp_path / "d")
    asked = []

    def ahead(name, also=()):
        asked.append((name, also))
        return warm

    monkeypatch.setattr(warm_start.precompile, "ahead", ahead)
    kernels = warm_start.KernelsAhead(torch.device("cuda", 0))
    assert kernels.started() == ("the 4 kernel specializations of this machine's runs: 4 compiled on an "
                                 "earlier run")
    assert kernels.finished() is None
    warm_start.KernelsAhead(torch.device("cuda", 0), blocks=True)  # the fused blocks' kernels too
    assert asked == [("ultralytics", ()), ("ultralytics", ("ultralytics-blocks",))]
