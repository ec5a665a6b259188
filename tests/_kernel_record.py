"""What kernels the CPU tier launches, as manifest entries: ``TRAINFUSE_KERNEL_MANIFEST=DIR
python -m pytest`` writes one manifest per test process into DIR, each entry one specialization the Triton
interpreter ran (its kernel, its arguments' types and alignment, its constexprs, ``num_warps``),
for :mod:`trainfuse._runtime.cross_compile` to compile for a GPU. Tests only: it wraps the
interpreter's launch (``InterpretedFunction.run``); a launch whose specialization no entry can
hold (a constexpr JSON cannot write) is counted by name instead.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path

_entries: dict[str, dict] = {}
unrecordable: set[str] = set()


def _constexpr_names(fn) -> set[str]:
    from triton.runtime.jit import _normalize_ty

    return {name for name, ty in inspect.get_annotations(fn.fn).items() if _normalize_ty(ty) == "constexpr"}


def note(fn, args: tuple, kwargs: dict) -> None:
    """Record the launch of interpreted kernel ``fn`` with ``args`` and ``kwargs``."""
    from trainfuse._runtime import precompile

    kwargs = dict(kwargs)
    num_warps = kwargs.pop("num_warps", 4)
    options = {k: kwargs.pop(k) for k in ("num_stages", "enable_fp_fusion", "num_ctas") if k in kwargs}
    bound = dict(zip(fn.arg_names, args))
    bound.update(kwargs)
    consts = _constexpr_names(fn)
    runtime = [bound[n] for n in fn.arg_names if n not in consts and n in bound]
    constexprs = {n: bound[n] for n in fn.arg_names if n in consts and n in bound}
    e = precompile.entry(fn, tuple(runtime), num_warps, constexprs, options)
    if e is None:
        unrecordable.add(f"{fn.fn.__module__}:{fn.fn.__qualname__}")
        return
    _entries.setdefault(json.dumps(e, sort_keys=True), e)


def install() -> Callable[[], None]:
    """Record every interpreted launch from now on; returns the function that stops it."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            note(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run

    def stop() -> None:
        InterpretedFunction.run = run

    return stop


def save(folder: str | Path, name: str | None = None) -> Path:
    """Write the entries recorded so far to ``folder``, in a file named after ``name`` (default:
    the xdist worker's name), and forget them."""
    from trainfuse._runtime import precompile

    name = name or os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = Path(folder) / f"kernels-{name}.json"
    precompile.save(path, list(_entries.values()))
    if unrecordable:
        (Path(folder) / f"unrecordable-{name}.txt").write_text("\n".join(sorted(unrecordable)) + "\n")
    _entries.clear()
    unrecordable.clear()
    return path
