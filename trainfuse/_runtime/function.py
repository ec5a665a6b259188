"""Calling an autograd Function straight through torch's C ``apply``.

Up to torch 2.11 at least, ``Function.apply`` is a Python classmethod around the C one: it binds
default arguments (when the Function defines ``setup_context``) and walks the arguments with
pytree to unwrap tensors of finished functorch transforms. On an H200 host that layer costs tens
of microseconds per call, which in a small model's step is as much as the work a fused kernel
saves (the tabular MLP's forward ran 0.24 ms slower in host time than torch's own layers). Newer
torch makes ``Function.apply`` the C method itself, and :func:`applier` then returns it unchanged.

Where the Python layer still exists, :func:`applier` calls the C method directly while no
functorch transform is active, and torch's ``apply`` otherwise (under ``vmap``/``grad`` the
wrappers matter). Our Functions define no ``setup_context``, so there are no defaults to bind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainfuse._runtime import compat

_C_APPLY = compat.function_c_apply


def applier(cls: type[torch.autograd.Function], *, direct: bool | None = None) -> Callable[..., Any]:
    """``cls.apply`` with the least host work this torch allows. ``direct`` forces (True) or
    refuses (False) the direct C call; None decides by the torch version."""
    if cls.__dict__.get("setup_context") is not None:
        raise TypeError(f"{cls.__name__} defines setup_context: call its apply, which binds defaults")
    if direct is None:
        direct = torch.autograd.Function.__dict__.get("apply") is not _C_APPLY
    if not direct:
        return cls.apply
    fast = _C_APPLY.__get__(None, cls)
    slow = cls.apply
    transforms_active = compat.functorch_transforms_active

    def apply(*args: Any) -> Any:
        return slow(*args) if transforms_active() else fast(*args)

    apply.__name__ = apply.__qualname__ = f"{cls.__name__}.apply"
    return apply


__all__ = ["applier"]
