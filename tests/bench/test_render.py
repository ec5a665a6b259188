"""benchmarks/render.py turns the reports the bench harness writes into the README's and the docs'
tables, and the committed tables match the committed results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from trainfuse.bench import _common as harness

ROOT = Path(__file__).resolve().parents[2]


def _load_render():
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


def _report(results: Path) -> dict:
    """A small optim report written by the harness, as a GPU run writes it."""
    report = harness.new_report("NVIDIA H200", 4200.0)
    report["_argv"] = ["--no-compile", "--out", "/somewhere"]
    workload = "AdamW, tiny (2 tensors)"
    harness.add_row(report, workload, "torch foreach", trainfuse=False, do_bench_ms=3.0, wall_ms=3.0,
                    floor_ms=0.5)
    harness.add_row(report, workload, "torch fused", trainfuse=False, do_bench_ms=2.0, wall_ms=2.0,
                    floor_ms=0.5)
    harness.add_row(report, workload, "trainfuse", trainfuse=True, do_bench_ms=0.9, wall_ms=1.0,
                    floor_ms=0.5)
    report["rebuild"] = {"untouched": 0.06}
    harness.save_report(report, str(results / "h200"), "optim")
    return json.loads((results / "h200" / "optim.json").read_text())


def test_save_report_writes_the_schema_render_reads(tmp_path):
    saved = _report(tmp_path)
    assert saved["schema"] == render.SCHEMA == harness.SCHEMA
    assert saved["family"] == "optim"
    assert saved["command"] == "python -m trainfuse.bench optim --no-compile"
    assert saved["device"] == "NVIDIA H200" and saved["headline"] == "wall_ms"
    assert {"torch", "triton", "trainfuse", "date"} <= set(saved)
    assert list(saved["metrics"]) == ["do_bench_ms", "wall_ms", "floor_ms"]
    assert saved["details"] == {"rebuild": {"untouched": 0.06}}
    assert [r["impl"] for r in saved["rows"]] == ["torch foreach", "torch fused", "trainfuse"]


def test_summary_compares_trainfuse_with_torchs_fastest(tmp_path):
    _report(tmp_path)
    results = render.load_results(tmp_path)
    table = render.summary(results, "benchmarks/results")
    assert "| AdamW, tiny (2 tensors) | wall ms | 2.000 (torch fused) | 1.000 | 2.00x |" in table
    # the command heads the family's table in the docs; the summary points to the data
    assert "python -m trainfuse.bench" not in table and "[`benchmarks/results/h200/`]" in table
    section = render.family_section("optim", results, "../benchmarks/results")
    assert "`python -m trainfuse.bench optim --no-compile`" in section


def test_summary_leaves_out_the_workloads_a_report_lists_as_sweep_points(tmp_path):
    report = harness.new_report("NVIDIA H200", 4200.0)
    report["_argv"] = []
    for workload in ("EMA update, model", "EMA update, 4 tensors"):
        harness.add_row(report, workload, "_foreach_lerp_", trainfuse=False, wall_ms=2.0)
        harness.add_row(report, workload, "trainfuse", trainfuse=True, wall_ms=1.0)
    report["summary_skip"] = ["EMA update, 4 tensors"]
    harness.save_report(report, str(tmp_path / "h200"), "ema")
    results = render.load_results(tmp_path)
    table = render.summary(results, "benchmarks/results")
    assert "| EMA update, model |" in table
    assert "EMA update, 4 tensors" not in table
    assert "| EMA update, 4 tensors |" in render.family_table(results["h200"]["ema"])


def test_versions_line_names_the_frameworks_and_the_dates_once_per_torch(tmp_path):
    runs = (("yolo", "2026-11-24", "8.4.190"), ("yolo-NAdam", "2026-11-27", "8.4.190"),
            ("optim", "2026-11-25", None), ("ema", "2026-11-26", None))
    for family, date, ultralytics in runs:
        report = harness.new_report("NVIDIA H200", 4200.0)
        report["_argv"] = []
        harness.add_row(report, "w", "stock", trainfuse=False, wall_ms=2.0)
        harness.add_row(report, "w", "trainfuse", trainfuse=True, wall_ms=1.0)
        if ultralytics:
            report["settings"] = {"ultralytics": ultralytics}
        harness.save_report(report, str(tmp_path / "h200"), family)
        path = tmp_path / "h200" / f"{family}.json"
        saved = json.loads(path.read_text())
        saved["date"] = date
        if family == "ema":
            saved["headline"] = None  # no summary row: its date is not the GPU's
        path.write_text(json.dumps(saved))
    reports = render.load_results(tmp_path)["h200"]
    torch_v, triton_v = reports["optim"]["torch"], reports["optim"]["triton"]
    assert render._versions(reports) == (f"torch {torch_v}, triton {triton_v}, ultralytics 8.4.190, "
                                         "measured 2026-11-24 to 2026-11-27")


def test_family_table_has_every_row_with_floor_and_ratio(tmp_path):
    _report(tmp_path)
    table = render.family_table(render.load_results(tmp_path)["h200"]["optim"])
    lines = table.splitlines()
    assert lines[0] == ("| workload | implementation | do_bench ms | wall ms | % floor | "
                        "vs torch's fastest |")
    assert lines[2] == "| AdamW, tiny (2 tensors) | torch foreach | 3.000 | 3.000 | 17 % | 0.67x |"
    assert lines[4] == "|  | **trainfuse** | 0.900 | 1.000 | 50 % | 2.00x |"


def _two_workloads(results: Path) -> dict[str, dict[str, dict]]:
    """An h200 optim report with two workloads and an h100 one with the first, as load_results reads them."""
    for gpu, workloads in (("h200", ("AdamW, tiny (2 tensors)", "SGD, tiny (2 tensors)")),
                           ("h100", ("AdamW, tiny (2 tensors)",))):
        report = harness.new_report("NVIDIA H200" if gpu == "h200" else "NVIDIA H100", 4200.0)
        report["_argv"] = []
        for workload in workloads:
            harness.add_row(report, workload, "torch fused", trainfuse=False, wall_ms=2.0)
            harness.add_row(report, workload, "trainfuse", trainfuse=True, wall_ms=0.5)
        harness.save_report(report, str(results / gpu), "optim")
    return render.load_results(results)


def test_headline_has_the_picked_workloads_of_one_gpu_in_their_order(tmp_path):
    results = _two_workloads(tmp_path)
    picks = (("optim", "SGD, tiny (2 tensors)"), ("optim", "AdamW, tiny (2 tensors)"))
    lines = render.headline(results, "benchmarks/results", gpu="h200", picks=picks).splitlines()
    assert lines[0].startswith("**NVIDIA H200**: torch ")
    assert lines[0].endswith("Data: [`benchmarks/results/h200/`](benchmarks/results/h200/).")
    assert lines[2:] == ["| workload | metric | torch's fastest | trainfuse | speedup |",
                         "|---|---|---|---|---|",
                         "| SGD, tiny (2 tensors) | wall ms | 2.000 (torch fused) | 0.500 | 4.00x |",
                         "| AdamW, tiny (2 tensors) | wall ms | 2.000 (torch fused) | 0.500 | 4.00x |"]
    # the summary has every workload of every GPU
    table = render.summary(results, "benchmarks/results")
    assert table.count("| AdamW, tiny (2 tensors) |") == 2 and table.count("| SGD, tiny (2 tensors) |") == 1


def test_headline_names_a_pick_the_results_do_not_have(tmp_path):
    results = _two_workloads(tmp_path)
    with pytest.raises(ValueError, match=r"no summary row for 'Adam, tiny \(2 tensors\)' in h200/optim.json"):
        render.headline(results, "x", gpu="h200", picks=(("optim", "Adam, tiny (2 tensors)"),))
    with pytest.raises(ValueError, match="in h200/ema.json"):
        render.headline(results, "x", gpu="h200", picks=(("ema", "AdamW, tiny (2 tensors)"),))
    assert render.headline(results, "x", gpu="a100", picks=()) == "No committed results yet.\n"


def test_marked_blocks_are_replaced_and_check_mode_sees_stale_ones(tmp_path, monkeypatch):
    _report(tmp_path / "results")
    monkeypatch.setattr(render, "HEADLINE", (("optim", "AdamW, tiny (2 tensors)"),))
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- results:headline:begin -->\nold\n<!-- results:headline:end -->\n"
                   "<!-- results:summary:begin -->\nold\n<!-- results:summary:end -->\n"
                   "<!-- results:optim:begin -->\n<!-- results:optim:end -->\n"
                   "<!-- results:ema:begin -->\n<!-- results:ema:end -->\nend\n")
    args = ["--results", str(tmp_path / "results"), str(doc)]
    assert render.main(["--check", *args]) == 1
    render.main(args)
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("end\n")
    # the headline and the summary rows, the family's row
    assert text.count("| AdamW, tiny (2 tensors) | wall ms | 2.000 (torch fused) | 1.000 | 2.00x |") == 2
    assert "| AdamW, tiny (2 tensors) | torch foreach |" in text
    assert "No committed results yet: run `python -m trainfuse.bench ema" in text
    assert "](results/h200/optim.json)" in text
    assert render.main(["--check", *args]) == 0


def test_a_report_of_another_schema_is_refused(tmp_path):
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "optim.json").write_text(json.dumps({"schema": 0, "family": "optim"}))
    with pytest.raises(ValueError, match="schema 0, expected 1"):
        render.load_results(tmp_path)


def test_committed_tables_match_committed_results():
    assert render.main(["--check"]) == 0, "run python benchmarks/render.py"


def _rows(text: str, name: str) -> list[str]:
    """The table rows of the ``results:<name>`` block of ``text``."""
    block = text.split(f"<!-- results:{name}:begin -->")[1].split(f"<!-- results:{name}:end -->")[0]
    lines = block.splitlines()
    return [line for line in lines if line.startswith("| ") and not line.startswith("| workload |")]


def test_readme_has_the_headline_table_and_the_docs_every_table():
    readme, docs = (ROOT / "README.md").read_text(), (ROOT / "docs" / "performance.md").read_text()
    headline = _rows(readme, "headline")
    assert [row.split(" | ")[0][2:] for row in headline] == [workload for _, workload in render.HEADLINE]
    assert set(headline) <= set(_rows(docs, "summary"))
    # one table in the README; the summary and the families' tables in the docs only
    assert readme.count("\n| workload | metric |") == 1 and "<!-- results:summary:begin -->" not in readme
    assert "<!-- results:headline:begin -->" not in docs
    for family in render.load_results()[render.HEADLINE_GPU]:
        assert f"<!-- results:{family}:begin -->" in docs, family
