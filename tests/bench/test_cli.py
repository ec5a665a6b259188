"""The benchmarks' shared command line (``python -m trainfuse.bench X``): each takes its options
and, without a GPU, says so and measures nothing."""

from __future__ import annotations

import importlib

import pytest
import torch

ARGS = {
    "amp": ["--only", "casts", "--steps", "3", "--gpt-batches", "8"],
    "ema": [],
    "losses": ["--no-compile", "--sizes", "100"],
    "mlp": ["--no-compile", "--only", "relu", "--sweep", "--set-to-none"],
    "optim": ["--no-compile", "--only", "GPT", "--sweep-only", "--configs", "512x8x4"],
    "lightning": ["--quick"],
    "yolo": ["--quick"],
    "yolo_loss": ["--quick"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() would run the benchmark")
@pytest.mark.parametrize("name", list(ARGS))
def test_each_benchmark_parses_its_options_and_needs_a_gpu(name, tmp_path, capsys):
    main = importlib.import_module(f"trainfuse.bench.{name}").main
    assert main(["--out", str(tmp_path), *ARGS[name]]) is None
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # no report written
    with pytest.raises(SystemExit):
        main(["--no-such-option"])
