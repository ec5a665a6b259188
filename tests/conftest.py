"""Test setup: without a CUDA GPU every kernel runs through the Triton interpreter.

The interpreter must be switched on before triton decorates the kernels, so this happens at import
time, before any test module imports trainfuse. On a GPU machine the same tests run the compiled
kernels on CUDA tensors.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed with
    TRAINFUSE_TEST_SEED."""
    seed = int(os.environ.get("TRAINFUSE_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    print(f"TRAINFUSE_TEST_SEED={seed}")
    yield


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def kernels(monkeypatch):
    """Force the Triton kernels (the interpreter on CPU) with a small chunk size, so that tensors
    of a few hundred elements already span several work items."""
    from trainfuse._multi_tensor.tables import config, master_config
    from trainfuse.losses import _common

    monkeypatch.setenv("TRAINFUSE_BACKEND", "triton")
    if DEVICE.type == "cpu":
        for cfg in (config, master_config, _common.config, _common.config16, _common.box_config):
            monkeypatch.setattr(cfg, "block", 32)
            monkeypatch.setattr(cfg, "unroll", 2)
    return config


def pytest_report_header(config):
    import triton

    return (f"trainfuse tests on {DEVICE} | torch {torch.__version__} | triton {triton.__version__}"
            f" | TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
