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


@pytest.mark.parametrize("workload", ["gpt", "tabular", "gpt-muon"])
@pytest.mark.parametrize("breakdown", [False, True])
def test_run_times_every_variant(tiny, workload, breakdown):
    pl = package()
    args = argparse.Namespace(breakdown=breakdown, verbose=False)
    stock = bench.run(pl, workload, "stock", 8, args)
    fused = bench.run(pl, workload, "fused", 8, args)
    graphs = bench.run(pl, workload, "graphs", 8, args)
    for r in (stock, fused, graphs):
        assert len(r["losses"]) == 8
        if breakdown:
            assert set(r["host_ms"]) == {"start -> forward", "forward -> backward", "backward -> before step",
                                         "before step -> end"}
        else:
            assert r["step_ms"] > 0 and r["optimizer_ms"] > 0
    swapped = {row["kind"] for row in fused["report"] if row["action"] == "swapped"}
    assert swapped == ({"optimizer", "mlp", "loss"} if workload == "tabular" else {"optimizer"})
    if workload == "gpt-muon":  # the module's two optimizers, both swapped
        assert [row["name"] for row in fused["report"] if row["kind"] == "optimizer"] == [
            "optimizer 0 (Muon)", "optimizer 1 (AdamW)"]
    # the torch path on CPU: the same training as stock; graphs are off on CPU, with the reason
    assert fused["losses"] == pytest.approx(stock["losses"], abs=1e-6)
    assert graphs["losses"] == fused["losses"]
    row = next(row for row in graphs["report"] if row["kind"] == "graphs")
    assert row["action"] == "skipped" and "CUDA device" in row["detail"]
    assert graphs["graph_stats"] == {} and "graph_stats" not in fused


def test_main_without_gpu_measures_nothing(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU main() would run the benchmark")
    assert bench.main(["--out", str(tmp_path), "--quick"]) is None
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_profile_and_plot(tiny, tmp_path, capsys):
    pl = package()
    bench.profile(pl, "tabular", "fused", str(tmp_path))
    assert "torch.profiler, tabular-fused" in capsys.readouterr().out
    assert (tmp_path / "lightning-tabular-fused.trace.json").exists()
    run = {"step_ms": 2.0, "optimizer_ms": 1.0, "losses": [0.7, 0.6]}
    results = {"tabular": {"stock": [run], "fused": [dict(run, step_ms=1.0)],
                           "graphs": [dict(run, step_ms=0.5)]}}
    png = bench.plot(results, str(tmp_path / "x.png"), bench.VARIANTS, bench.LABELS)
    assert png is not None and (tmp_path / "x.png").stat().st_size > 0


def test_goals_read_every_figure():
    def variant(step, opt, loss, reserved):
        return {"step_ms": step, "optimizer_ms": opt, "final_loss": loss, "peak_reserved_gb": reserved}

    med = {"stock": variant(4.0, 1.0, 2.0, 1.0), "fused": variant(2.0, 0.1, 2.01, 1.0),
           "graphs": variant(1.0, 0.1, 2.1, 1.4)}
    lines = bench._goals("tabular", med)
    assert lines == ["step 2.00x (met >= 1.2x)", "step with CUDA graphs 4.00x (met >= 2.0x)",
                     "fused loss 0.50% (met <= 1%)", "graphs loss 5.00% (missed <= 1%)",
                     "peak reserved memory with graphs 1.40x the run without (missed <= 1.3x)"]
    gpt = bench._goals("gpt", dict(med, graphs=variant(3.0, 0.1, 2.0, 1.2)))
    assert gpt[1] == "optimizer 10.00x (met >= 5.0x)"
    assert gpt[2] == "step with CUDA graphs 1.33x (missed >= 1.6x)"
