"""A faster Triton interpreter for the CPU tier: a device function's call skips re-patching
``triton.language`` when the running kernel's own patch already covers it.

The interpreter patches ``triton.language`` (each builtin, the tensor's operators) before a
kernel runs, restores it after, and patches it *again* on every call of a ``@triton.jit``
helper inside the kernel (``InterpretedFunction.__call__``): a fifth of the interpreter's time
in a kernel built from helpers, as trainfuse's are, and nothing the kernel's own patch had not
done. Here a helper's call skips it where the kernel's patch covers the helper's language modules
and is still in place (``tl.load`` as the kernel's patch left it); anything else patches as
Triton does. Installed by ``tests/conftest.py`` under the interpreter; tests only. (Triton's
interpreter runs one kernel at a time: kernels launched from several threads at once fail with
it as they do without it.)
"""

from __future__ import annotations

import inspect
import threading

_local = threading.local()
skipped = 0  # helper calls that skipped re-patching (tests/test_interpreter.py counts them)


class _Kept:
    """The scope of a skipped patch: nothing to restore (the kernel's own scope restores)."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap the interpreter's patching; False (and nothing changed) where this Triton's
    interpreter lacks the two names it wraps."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    grid = getattr(interpreter, "GridExecutor", None)
    if patch is None or grid is None or getattr(patch, "trainfuse_kept", False):
        return patch is not None and getattr(patch, "trainfuse_kept", False)
    run_grid = grid.__call__

    def _patch_lang(fn):
        runs = getattr(_local, "runs", None)
        modules = (tl, tl.core)
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in modules)
        if runs:
            top = runs[-1]
            if top is not None and langs <= top[0] and tl.load is top[1]:
                global skipped
                skipped += 1
                return _Kept()
            scope = patch(fn)
            if top is None:  # the kernel's own patch: what its helpers' calls may skip
                runs[-1] = (langs, tl.load)
            return scope
        return patch(fn)

    def __call__(self, *args, **kwargs):
        runs = _local.__dict__.setdefault("runs", [])
        runs.append(None)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            runs.pop()

    _patch_lang.trainfuse_kept = True
    interpreter._patch_lang = _patch_lang
    grid.__call__ = __call__
    return True
