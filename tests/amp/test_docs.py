"""The docstring examples of trainfuse.amp run and print what they say."""

import doctest

import pytest
import torch

from trainfuse.amp import casts, clip


@pytest.mark.parametrize("module", [casts, clip], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
