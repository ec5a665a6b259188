"""Which path runs: the Triton kernels or the plain-torch reference.

``TRAINFUSE_BACKEND`` picks it, read at every call so tests can switch it:

- ``auto`` (default): Triton for CUDA tensors, torch for everything else.
- ``triton``: the kernels everywhere. On CPU tensors this needs the Triton interpreter
  (``TRITON_INTERPRET=1`` set before ``trainfuse`` is imported); that is how CI runs every kernel.
- ``torch``: the reference path everywhere.

Code that ``torch.compile`` traces takes the torch path whatever the setting: dynamo cannot trace
a Triton launch from Python, and the torch path is what it compiles well.
"""

from __future__ import annotations

import functools
import os

import torch

_CHOICES = ("auto", "triton", "torch")


def backend() -> str:
    """The backend named by ``TRAINFUSE_BACKEND`` (``auto`` when unset)."""
    name = os.environ.get("TRAINFUSE_BACKEND", "auto").strip().lower() or "auto"
    if name not in _CHOICES:
        raise ValueError(f"TRAINFUSE_BACKEND={name!r}: expected one of {', '.join(_CHOICES)}")
    return name


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the Triton kernels (never inside code ``torch.compile``
    traces)."""
    if torch.compiler.is_compiling():
        return False
    name = backend()
    if name == "torch":
        return False
    if name == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError("TRAINFUSE_BACKEND=triton but triton is not installed")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"TRAINFUSE_BACKEND=triton on a {device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing trainfuse"
        )
    return True


def describe() -> str:
    """One line saying what runs here, for demos and benchmarks."""
    if not torch.cuda.is_available():
        if backend() == "triton" and interpreting():
            return "no GPU: Triton kernels run through the interpreter (slow, for testing)"
        return "no GPU: using torch fallback"
    import triton

    return (
        f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}"
        f" | backend {backend()}"
    )
