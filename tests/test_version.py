"""The version is stated once, in trainfuse/__init__.py: pyproject.toml reads it from there, and
the installed package's metadata agrees with it."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

import trainfuse

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_pyproject_takes_the_version_from_the_package():
    config = tomllib.loads(PYPROJECT.read_text())
    assert "version" not in config["project"], "pyproject.toml states a version of its own"
    assert "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "trainfuse.__version__"}


def test_installed_metadata_matches_the_package():
    try:
        installed = importlib.metadata.version("trainfuse")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("trainfuse runs from a source tree on PYTHONPATH: no installed metadata to compare")
    assert installed == trainfuse.__version__, (
        f"installed metadata says {installed}, trainfuse/__init__.py says {trainfuse.__version__}: "
        "reinstall (pip install -e .)")


def test_version_is_a_release_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", trainfuse.__version__)
