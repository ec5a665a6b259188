"""The docstring examples of trainfuse.losses run and print what they say."""

import doctest

import pytest
import torch

from trainfuse.losses import bce, iou


@pytest.mark.parametrize("module", [iou, bce], ids=lambda m: m.__name__)
def test_docstring_examples(module, device, monkeypatch):
    if device.type == "cpu":  # no GPU: the examples' CPU tensors go through the interpreted kernels
        monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
