"""The docstring examples of every public trainfuse module run and print what they say.

Modules are found on disk: every ``trainfuse/**/*.py`` whose dotted name has no ``_private`` part
and whose source holds a ``>>>`` example, so a module that moves or a new package is picked up
without editing this file. Without a GPU the examples' CPU tensors take the kernels through the
interpreter; on a GPU machine (no interpreter) CPU tensors take the torch path.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest
import torch

import trainfuse

PACKAGE = Path(trainfuse.__file__).parent


def public_modules_with_examples() -> list[str]:
    """Dotted names of the public modules whose source has a docstring example."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts) or ">>>" not in path.read_text():
            continue
        names.append(".".join(parts))
    return names


MODULES = public_modules_with_examples()


def test_examples_of_the_core_packages_are_found():
    """The walk reaches into the packages users import first (a broken walk would run nothing)."""
    found = {name.split(".")[1] for name in MODULES}
    assert {"optim", "amp", "losses", "nn"} <= found, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, device, request):
    """Every example runs (but those marked ``+SKIP``, e.g. ones that need a trained model) and
    prints what its docstring says."""
    if device.type == "cpu":
        request.getfixturevalue("kernels")
    module = importlib.import_module(name)
    examples = sum(len(test.examples) for test in doctest.DocTestFinder().find(module))
    assert examples > 0, f"{name} has '>>>' outside its docstrings"
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
