"""Fixtures of the FusedTraining tests."""

import pytest


@pytest.fixture
def torch_path(monkeypatch):
    """The fused optimizers' torch path (torch.optim's own math), also on a GPU: the runs the tests
    compare for exact equality with stock Lightning. On CPU this is already the default."""
    monkeypatch.setenv("TRAINFUSE_BACKEND", "torch")
