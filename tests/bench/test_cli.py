"""The benchmarks' command line: ``python -m trainfuse.bench`` names every family and what it
measures, refuses unknown ones, and hands the rest of the line to the family, whose options and
usage line are its own; without a GPU a family says so and measures nothing."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from trainfuse.bench import __main__ as cli
from trainfuse.bench._common import FAMILIES, bench_parser, format_columns

ARGS = {
    "amp": ["--only", "casts", "--steps", "3", "--gpt-batches", "8"],
    "ema": [],
    "losses": ["--no-compile", "--sizes", "100"],
    "mlp": ["--no-compile", "--only", "relu", "--sweep", "--set-to-none"],
    "optim": ["--no-compile", "--only", "GPT", "--sweep-only", "--configs", "512x8x4"],
    "lightning": ["--quick"],
    "stem": ["--batch", "2", "--imgsz", "64"],
    "blocks": ["--batch", "2"],
    "muon": [],
    "augment": ["--batch", "2", "--imgsz", "64"],
    "yolo": ["--quick"],
    "yolo-quality": ["--models", "yolov5n.yaml", "--seeds", "0", "--epochs", "1"],
    "yolo-loss": ["--quick"],
}


def test_every_family_has_options_to_test():
    assert set(ARGS) == set(FAMILIES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() would run the benchmark")
@pytest.mark.parametrize("family", list(ARGS))
def test_each_benchmark_parses_its_options_and_needs_a_gpu(family, tmp_path, capsys):
    main = importlib.import_module(FAMILIES[family][0]).main
    assert main(["--out", str(tmp_path), *ARGS[family]]) is None
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # no report written
    with pytest.raises(SystemExit):
        main(["--no-such-option"])


@pytest.mark.parametrize("help_flag", ["-h", "--help"])
def test_help_lists_every_family_with_what_it_measures(help_flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([help_flag])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m trainfuse.bench <family> [options]")
    for family, (_, what) in FAMILIES.items():
        assert f"  {family.ljust(max(map(len, FAMILIES)))}  {what}\n" in out


def test_no_family_prints_the_help_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert all(what in err for _, what in FAMILIES.values())


@pytest.mark.parametrize("argv,word", [(["nosuch"], "family"), (["--out", "x", "optim"], "option")])
def test_an_unknown_family_is_refused_by_name(argv, word, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown {word} {argv[0]!r}" in err
    assert ", ".join(FAMILIES) in err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_help_names_the_command_that_runs_it(family, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([family, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m trainfuse.bench {family} ")


def test_the_module_runs_as_a_program():
    out = subprocess.run([sys.executable, "-m", "trainfuse.bench", "nosuch"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "unknown family 'nosuch'" in out.stderr


def test_a_parser_for_an_unlisted_family_is_refused():
    with pytest.raises(ValueError, match="family 'nosuch'"):
        bench_parser("nosuch", "doc")


def test_format_columns_pads_every_column_to_its_widest_cell():
    text = format_columns(["a", "bbb"], [["xx", 1], ["y", 22.5]])
    assert text.split("\n") == ["a   bbb ", "--  ----", "xx  1   ", "y   22.5"]
