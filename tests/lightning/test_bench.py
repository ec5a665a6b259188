"""The Lightning benchmark's machinery on CPU with tiny sizes (the timings need a GPU: there
main() runs; here it says so and writes nothing)."""

import argparse

import pytest
import torch

from tests.lightning.helpers import package
from trainfuse.bench import lightning as bench


@pytest.fixture
def tiny(monkeypatch):
    for name, value in dict(DEVICE="cpu", V=64, D=16, HEADS=2, LAYERS=1, T=8, GPT_BATCH=2, TAB_IN=16,
                            TAB_WIDTH=16, TAB_OUT=4, TAB_BATCH=8, WARMUP=2, PHASE_EVERY=2).items():
        monkeypatch.setattr(bench, name, value)


def test_corpus_is_deterministic_and_does_not_repeat(tiny):
    a, b = bench.bigram_corpus(16, 9), bench.bigram_corpus(16, 9)
    assert torch.equal(a, b)
    assert len({tuple(r.tolist()) for r in a}) == 16
    assert a.min() >= 0 and a.max() < bench.V


@pytest.mark.parametrize("workload", ["gpt", "tabular"])
@pytest.mark.parametrize("breakdown", [False, True])
def test_run_times_both_variants(tiny, workload, breakdown):
    pl = package()
    args = argparse.Namespace(breakdown=breakdown, verbose=False)
    stock = bench.run(pl, workload, False, 8, args)
    fused = bench.run(pl, workload, True, 8, args)
    for r in (stock, fused):
        assert len(r["losses"]) == 8
        if breakdown:
            assert set(r["host_ms"]) == {"start -> forward", "forward -> backward", "backward -> before step",
                                         "before step -> end"}
        else:
            assert r["step_ms"] > 0 and r["optimizer_ms"] > 0
    swapped = {row["kind"] for row in fused["report"] if row["action"] == "swapped"}
    assert swapped == ({"optimizer"} if workload == "gpt" else {"optimizer", "mlp", "loss"})
    # the torch path on CPU: the same training as stock
    assert fused["losses"] == pytest.approx(stock["losses"], abs=1e-6)


def test_main_without_gpu_measures_nothing(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU main() would run the benchmark")
    assert bench.main(["--out", str(tmp_path), "--quick"]) is None
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_profile_and_plot(tiny, tmp_path, capsys):
    pl = package()
    bench.profile(pl, "tabular", True, str(tmp_path))
    assert "torch.profiler, tabular-fused" in capsys.readouterr().out
    assert (tmp_path / "lightning-tabular-fused.trace.json").exists()
    run = {"step_ms": 2.0, "optimizer_ms": 1.0, "losses": [0.7, 0.6]}
    results = {"tabular": {"stock": [run], "fused": [dict(run, step_ms=1.0)]}}
    png = bench.plot(results, str(tmp_path / "x.png"))
    assert png is not None and (tmp_path / "x.png").stat().st_size > 0
