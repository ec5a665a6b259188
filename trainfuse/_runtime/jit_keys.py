"""Triton cache keys that do not depend on the order a process first hashes its kernels in.

A ``@triton.jit`` function's cache key covers its source, the keys of the JIT functions it calls
and the global ``tl.constexpr`` values it and they read. Triton up to 3.6 merges a callee's
globals into the caller's key *before* computing the callee's key, so a callee not hashed yet
adds none: the key of a kernel then depends on which kernels this process hashed before it.
A worker that compiles a kernel ahead (:mod:`trainfuse._runtime.precompile`) and the run that
launches it hash in different orders and file one kernel under two keys; the launch misses the
worker's cache entry and compiles it again.

:func:`settle` hashes a kernel's JIT callees before the kernel, callees' callees first: the key
newer Triton gives in any order. The launcher settles each kernel before its first launch (with
its constexprs), ``launch_update`` the chunk function it passes as a constexpr, the precompile
hooks each first launch, and the workers each kernel before they compile it.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

from trainfuse._runtime import compat

# a name, or a module's attribute, anywhere in a kernel's source: a superset of what it calls
_NAME = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(?:\s*\.\s*([A-Za-z_]\w*))?")


def _callees(fn) -> list:
    """The JIT functions ``fn``'s source names (through its module's globals), not hashed yet."""
    scope = fn.__globals__
    found = []
    for name, attr in _NAME.findall(fn.src):
        value = scope.get(name)
        if attr and isinstance(value, ModuleType):
            value = getattr(value, attr, None)
        if value is not fn and compat.jit_key_pending(value):
            found.append(value)
    return found


def settle(*values: Any) -> None:
    """Compute the cache keys of the JIT functions among ``values`` (a kernel and its
    constexprs; anything else is skipped) and of what they call, each after its callees'.
    Keys this process computed already are kept as they are."""
    seen: set[int] = set()  # expanded: its callees pushed (a cycle's way back is not followed)
    for root in values:
        if not compat.jit_key_pending(root):
            continue
        stack = [(root, False)]
        while stack:
            fn, expanded = stack.pop()
            if expanded:
                fn.cache_key  # noqa: B018 - computed now, its callees' before it
            elif id(fn) not in seen:
                seen.add(id(fn))
                stack.append((fn, True))
                stack.extend((c, False) for c in _callees(fn) if id(c) not in seen)


__all__ = ["settle"]
