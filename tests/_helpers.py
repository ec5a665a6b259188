"""Markers and helpers shared by the test packages (import them: ``from tests._helpers import cuda``)."""

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
