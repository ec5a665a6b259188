"""Compiling the Triton kernels a run is going to launch before it launches them, in worker
processes, while the run sets itself up.

On a machine whose Triton cache is empty, each kernel compiles the first time it launches: Python
code generation, then ``ptxas`` and a C compiler for its launcher, one to two seconds per kernel,
one kernel after another, inside the first training step. What a kernel compiles to depends only
on its source, its constexprs and what Triton specializes its arguments on (element types, 16-byte
alignment of pointers, integers equal to 1 or divisible by 16), so a list of those, a *manifest*,
is enough to compile the same kernels elsewhere: :func:`ahead` starts ``python -m
trainfuse._runtime.precompile`` worker processes that compile the manifest's entries into Triton's
cache (the same ``TRITON_CACHE_DIR``), and the run's own launches then find them there.

A manifest comes from two places, merged: the one shipped for a client
(``trainfuse/_runtime/manifests/<name>.json``, the kernels its default runs launch) and the one
this machine recorded on earlier runs (:func:`remember`, under ``TRAINFUSE_CACHE_DIR`` or
``~/.cache/trainfuse``). :class:`~trainfuse._runtime.launch.CachedLauncher` records every
specialization it compiles (:func:`record`). An entry the run never launches costs a worker some
CPU time and nothing else; a kernel the manifest lacks compiles in the run, as without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from trainfuse._runtime import compat, jit_keys

VERSION = 1
_SHIPPED = Path(__file__).with_name("manifests")
_lock = threading.Lock()
_recorded: dict[str, dict] = {}  # the entries this process compiled, by their JSON text
_unrecordable: set[str] = set()  # kernels launched with no stand-in for an entry
_first: list[tuple[str, float]] = []  # (kernel, seconds) of each first launch (first_launch)


# ---- entries: what Triton specializes a launch on, as JSON ---------------------------------------
def arg_spec(a: Any) -> list:
    """What Triton specializes argument ``a`` on: ``["tensor", dtype, aligned]``, ``["int", one,
    by16, wide]`` or ``["float"]``."""
    if isinstance(a, torch.Tensor):
        return ["tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0]
    if isinstance(a, bool):
        raise TypeError("a bool argument is a constexpr in trainfuse's kernels")
    if isinstance(a, int):
        return ["int", a == 1, a % 16 == 0, not -(2**31) <= a < 2**31]
    return ["float"]


def mock_arg(spec: list, device: str | torch.device = "cuda") -> Any:
    """An argument Triton specializes as it did the one ``spec`` describes: a small tensor of the
    dtype on ``device``, 16-byte aligned or one element off it; an int of the same classes; a float."""
    kind = spec[0]
    if kind == "tensor":
        t = torch.empty(16, dtype=getattr(torch, spec[1]), device=device)
        return t if spec[2] else t[1:]
    if kind == "int":
        _, one, by16, wide = spec
        if one:
            return 1
        return (2**32 if wide else 0) + (16 if by16 else 17)
    return 1.5


def _const(value: Any) -> Any:
    """A constexpr as JSON: a Triton dtype as ``{"tl.dtype": name}``, a JIT function (a kernel's
    device-function argument) as ``{"jit": "module:qualname"}``, a ``tl.constexpr`` object (a
    module's named constant passed as is: Triton keys it apart from its bare value) as
    ``{"constexpr": value}``; None where JSON cannot hold it."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__name__ == "constexpr" and type(value).__module__.startswith("triton"):
        inner = _const(value.value)
        return None if inner is None or isinstance(inner, dict) else {"constexpr": inner}
    inner = getattr(value, "fn", None)
    if inner is not None and hasattr(value, "arg_names"):
        return {"jit": f"{inner.__module__}:{inner.__qualname__}"}
    name, kind = getattr(value, "name", None), type(value)
    if kind.__name__ == "dtype" and kind.__module__.startswith("triton") and isinstance(name, str):
        return {"tl.dtype": name}
    return None


def _unconst(value: Any) -> Any:
    if isinstance(value, dict) and "jit" in value:
        return resolve({"fn": value["jit"]})
    if isinstance(value, dict):
        import triton.language as tl

        if "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return tl.dtype(value["tl.dtype"])
    return value


# kernels whose stand-in launch compiles to another Triton cache entry than the launch it was
# recorded from ("module:qualname"): compiling them ahead would only cost a worker and make the run
# wait for it. None now: the one there was (the multi-tensor update kernel) differed by the order
# Triton up to 3.6 hashed its helpers in, which jit_keys settles in the run and the workers alike.
NO_STAND_IN: frozenset[str] = frozenset()


def entry(fn, args: tuple, num_warps: int, constexprs: dict, options: dict | None = None) -> dict | None:
    """The manifest entry of one launch of JIT function ``fn`` (``options``: compile options other
    than ``num_warps``, such as ``enable_fp_fusion``), or None where it has no stand-in (a
    constexpr JSON cannot hold, a bool argument)."""
    inner = getattr(fn, "fn", None)
    if inner is None or f"{inner.__module__}:{inner.__qualname__}" in NO_STAND_IN:
        return None
    try:
        specs = [arg_spec(a) for a in args]
    except TypeError:
        return None
    unspecialized = compat.unspecialized_args(fn)
    for spec, name in zip(specs, fn.arg_names):
        if spec[0] == "int" and name in unspecialized:
            spec[1:3] = [False, False]  # Triton keys such an int on its width alone
    consts = {k: _const(v) for k, v in constexprs.items()}
    if any(v is None for v in consts.values()):
        return None
    e = {"fn": f"{inner.__module__}:{inner.__qualname__}", "args": specs, "num_warps": num_warps,
         "constexprs": consts}
    if options:
        e["options"] = dict(options)
    return e


def _note(fn, args: tuple, num_warps: int, constexprs: dict, options: dict | None) -> tuple[str, bool]:
    """Record a launch's entry (:func:`recorded`): its JSON text (the kernel's name where it has no
    stand-in) and whether this process sees it for the first time."""
    jit_keys.settle(fn, *constexprs.values())
    e = entry(fn, args, num_warps, constexprs, options)
    if e is None:
        inner = getattr(fn, "fn", fn)
        text = f"{getattr(inner, '__module__', '?')}:{getattr(inner, '__qualname__', repr(fn))}"
        with _lock:
            new = text not in _unrecordable
            _unrecordable.add(text)
        return text, new
    text = json.dumps(e, sort_keys=True)
    with _lock:
        new = text not in _recorded
        _recorded.setdefault(text, e)
    return text, new


def launching(fn, args: tuple, num_warps: int, constexprs: dict, options: dict | None = None) -> None:
    """Before a launch of a specialization this process may not have compiled yet: note it (for
    :func:`remember`) and, where a worker of :func:`ahead` is compiling it, wait for the worker,
    so that the launch finds it in Triton's cache instead of compiling it a second time."""
    text, _ = _note(fn, args, num_warps, constexprs, options)
    workers = _active
    if workers is not None:
        workers.wait_for(text)


@contextlib.contextmanager
def first_launch(fn, args: tuple, num_warps: int, constexprs: dict, options: dict | None = None):
    """:func:`launching`, then time the launch made inside the ``with`` block where it is this
    process's first of its specialization (the compile, or the load from Triton's cache; a wait
    for a worker is counted apart): :func:`first_launches` lists them."""
    text, new = _note(fn, args, num_warps, constexprs, options)
    workers = _active
    if workers is not None:
        workers.wait_for(text)
    start = time.perf_counter()
    yield
    if new:
        inner = getattr(fn, "fn", fn)
        with _lock:
            _first.append((getattr(inner, "__qualname__", repr(fn)), time.perf_counter() - start))


def first_launches() -> list[tuple[str, float]]:
    """``(kernel name, seconds)`` of each specialization's first launch in this process (through
    :func:`first_launch`), in order: a compile where Triton's cache lacked it."""
    with _lock:
        return list(_first)


def unrecordable() -> list[str]:
    """The kernels launched with a specialization no manifest entry can describe (compiled in the
    run on a cold cache whatever the manifest holds)."""
    with _lock:
        return sorted(_unrecordable)


def summary(waited: float = 0.0, since: int = 0, failures: list[tuple[str, str]] = (),
            waits: dict[str, float] | None = None) -> str | None:
    """A line for a log: how many specializations were first launched in this process (after the
    first ``since`` of :func:`first_launches`) and how long that took, the slowest named; how long
    launches ``waited`` for the compile workers, the longest ``waits`` per kernel
    (:attr:`Ahead.waits`) named; the kernels no manifest entry describes; the ``failures`` of the
    workers (:attr:`Ahead.failures`). None where there is nothing to say."""
    firsts = first_launches()[since:]
    parts = []
    if firsts:
        total = sum(s for _, s in firsts)
        slowest = ", ".join(f"{name} {s:.1f} s" for name, s in sorted(firsts, key=lambda f: -f[1])[:3])
        parts.append(f"{len(firsts)} kernel specializations first launched in {total:.1f} s "
                     f"(slowest: {slowest})")
    if waited:
        longest = sorted(((s, name) for name, s in (waits or {}).items() if s >= 0.05), reverse=True)[:3]
        named = f" ({', '.join(f'{name} {s:.1f} s' for s, name in longest)})" if longest else ""
        parts.append(f"launches waited {waited:.1f} s for the compile workers{named}")
    if firsts and (missing := unrecordable()):
        parts.append(f"not compiled ahead (no manifest entry): {', '.join(missing)}")
    if failures:
        kernel, error = failures[0]
        first = error.splitlines()[0] if error else ""
        parts.append(f"the compile workers failed on {len(failures)} (first: {kernel}: {first})")
    return "; ".join(parts) or None


def recorded() -> list[dict]:
    """The entries this process recorded, in the order first seen."""
    with _lock:
        return list(_recorded.values())


# ---- manifests on disk --------------------------------------------------------------------------
def _triton_version() -> str:
    import triton

    return triton.__version__


def cache_dir() -> Path:
    """Where this machine's manifests live: ``TRAINFUSE_CACHE_DIR``, else ``~/.cache/trainfuse``."""
    root = os.environ.get("TRAINFUSE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "trainfuse"


def _user_manifest(name: str) -> Path:
    return cache_dir() / f"kernels-{name}-triton{_triton_version()}.json"


def load(path: Path) -> list[dict]:
    """A manifest's entries (but those of :data:`NO_STAND_IN`); an absent, unreadable or
    other-version file has none."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return []
    return [e for e in data.get("entries", []) if isinstance(e, dict) and "fn" in e
            and e["fn"] not in NO_STAND_IN]


def save(path: Path, entries: list[dict]) -> None:
    """Write ``entries`` to ``path`` whole or not at all (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": VERSION, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def manifest(name: str, also: tuple[str, ...] = ()) -> list[dict]:
    """The entries to compile ahead for client ``name``: the shipped ones, this machine's, then
    the shipped manifests named in ``also`` (a client's optional parts)."""
    seen: dict[str, dict] = {}
    shipped_also = [e for part in also for e in load(_SHIPPED / f"{part}.json")]
    for e in load(_SHIPPED / f"{name}.json") + load(_user_manifest(name)) + shipped_also:
        seen.setdefault(json.dumps(e, sort_keys=True), e)
    return list(seen.values())


def remember(name: str) -> Path | None:
    """Add what this process compiled to this machine's manifest for ``name``; returns its path,
    or None where nothing was recorded or the cache folder cannot be written."""
    new = recorded()
    if not new:
        return None
    path = _user_manifest(name)
    seen = {json.dumps(e, sort_keys=True): e for e in load(path)}
    before = len(seen)
    for e in new:
        seen.setdefault(json.dumps(e, sort_keys=True), e)
    if len(seen) == before and path.exists():
        return path
    try:
        save(path, list(seen.values()))
    except OSError:
        return None
    return path


# ---- compiling ahead ----------------------------------------------------------------------------
def _triton_cache() -> Path:
    try:
        import triton

        return Path(triton.knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _done_log() -> Path:
    """Where workers list what they compiled, for this Triton version, GPU and Triton cache: an
    entry listed there is not compiled ahead again while that cache folder holds anything."""
    major, minor = torch.cuda.get_device_capability()
    tag = f"{_triton_version()}|{major}.{minor}|{_triton_cache().resolve()}"
    return cache_dir() / f"compiled-{hashlib.sha1(tag.encode()).hexdigest()[:16]}.txt"


def _read_done(path: Path) -> set[str]:
    try:
        return set(path.read_text().splitlines())
    except OSError:
        return set()


class Ahead:
    """Worker processes compiling a manifest (:func:`ahead`). A launch of a specialization they
    compile waits for it (:func:`launching`); :meth:`stop` ends them.

    Attributes:
        entries: the manifest's entries; ``compiled_before``: those a worker compiled on an
            earlier run into the same Triton cache (not compiled again); ``pending``: the rest,
            given to ``workers`` processes.
    """

    def __init__(self, entries: int, compiled_before: int, pending: list[str], done: Path) -> None:
        self.entries, self.compiled_before = entries, compiled_before
        self.pending = set(pending)
        self.processes: list[subprocess.Popen] = []
        self.started = time.perf_counter()
        self.waited = 0.0  # seconds launches spent waiting for the workers
        self.waits: dict[str, float] = {}  # of them, per kernel (its qualified name)
        self.failures: list[tuple[str, str]] = []  # (kernel, error) the workers failed on, once stopped
        self._done_path, self._done, self._manifest = done, set(), None

    @property
    def workers(self) -> int:
        return len(self.processes)

    def _running(self) -> bool:
        return any(p.poll() is None for p in self.processes)

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        """Wait until a worker has compiled entry ``text`` (or every worker has ended, or
        ``timeout`` seconds); at once for an entry no worker is compiling."""
        if text not in self.pending:
            return
        start = time.perf_counter()
        while text not in self._done and self._running() and time.perf_counter() - start < timeout:
            time.sleep(0.01)
            self._done = _read_done(self._done_path)
        self.pending.discard(text)
        seconds = time.perf_counter() - start
        self.waited += seconds
        name = _kernel_name(text)
        self.waits[name] = self.waits.get(name, 0.0) + seconds

    def stop(self) -> None:
        """End the workers still running (what they had left compiles in the run, if launched)."""
        global _active
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.wait()
        if self._manifest is not None:
            Path(self._manifest).unlink(missing_ok=True)
            shutil.rmtree(_claims(self._manifest), ignore_errors=True)
            self._manifest = None
        self.failures = worker_failures(self._done_path)
        _failed_log(self._done_path).unlink(missing_ok=True)
        if _active is self:
            _active = None


_active: Ahead | None = None

# a worker: :func:`main` at a lower priority than the run's own processes (``os.nice``, where the OS
# has it), from its first import on. The run sets itself up meanwhile (the model's CPU forward runs
# on every core; the dataset check on eight threads) and needs no kernel before its first step:
# the workers take the CPU time that setup leaves idle instead of slowing it down
_WORKER = ("import os, runpy; hasattr(os, 'nice') and os.nice(10); "
           "runpy.run_module('trainfuse._runtime.precompile', run_name='__main__', alter_sys=True)")


def ahead(name: str, workers: int | None = None, also: tuple[str, ...] = ()) -> Ahead | None:
    """Start compiling client ``name``'s manifest (:func:`manifest`, with the shipped ones named
    in ``also``) in up to ``workers`` processes (default: half the CPUs, at most 8), leaving out
    what workers compiled into the same Triton cache before;
    None where there is nothing to do (no CUDA, no manifest, all compiled before, the Triton
    interpreter, ``TRAINFUSE_PRECOMPILE=0``, no cache folder to write: a read-only home)."""
    from trainfuse._runtime.backend import interpreting

    if os.environ.get("TRAINFUSE_PRECOMPILE", "1") == "0" or interpreting() or not torch.cuda.is_available():
        return None
    try:
        entries = manifest(name, also)
        return _start(entries, workers) if entries else None
    except (OSError, RuntimeError):  # the kernels compile in the run, as without a manifest
        return None


def _start(entries: list[dict], workers: int | None) -> Ahead:
    global _active
    done = _done_log()
    cache = _triton_cache()
    before = _read_done(done) if cache.is_dir() and any(cache.iterdir()) else set()
    texts = [json.dumps(e, sort_keys=True) for e in entries]
    todo = [(t, e) for t, e in zip(texts, entries) if t not in before]
    handle = Ahead(len(entries), len(entries) - len(todo), [t for t, _ in todo], done)
    if not todo:
        return handle
    workers = min(workers or max(1, min(8, (os.cpu_count() or 2) // 2)), len(todo))
    done.parent.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="trainfuse-manifest-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": VERSION, "entries": [e for _, e in todo]}, f)
    handle._manifest = path
    for i in range(workers):
        handle.processes.append(subprocess.Popen(
            [sys.executable, "-c", _WORKER, path, str(i), str(workers), str(done)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if _active is not None:
        _active.stop()
    _active = handle
    return handle


def resolve(e: dict):
    """The JIT function an entry names."""
    import importlib

    module, _, qualname = e["fn"].partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def constexprs_of(e: dict) -> dict:
    """An entry's constexprs as a launch passes them (Triton dtypes, JIT functions, ``tl.constexpr``
    objects back from their JSON form)."""
    return {k: _unconst(v) for k, v in e["constexprs"].items()}


def compile_entry(e: dict) -> None:
    """Compile one entry into Triton's cache, its launcher too."""
    fn = resolve(e)
    constexprs = constexprs_of(e)
    jit_keys.settle(fn, *constexprs.values())  # the keys the run's launch computes (jit_keys)
    kernel = fn.warmup(*[mock_arg(s) for s in e["args"]], grid=(1,), num_warps=e["num_warps"],
                       **constexprs, **e.get("options", {}))
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    kernel.run  # noqa: B018 - loads the module and builds the launcher, cached beside the kernel


def main(argv: list[str]) -> int:
    """``python -m trainfuse._runtime.precompile MANIFEST INDEX COUNT [DONE]``: worker INDEX of
    COUNT. It compiles entry INDEX first, then each entry after it (wrapping around) that no other
    worker has claimed (a file per entry in ``MANIFEST.claims``, made exclusively): a worker whose
    first entry is a long compile holds up no other. Each compiled entry is appended to the file
    DONE (one line of JSON, in one write), each that failed to ``DONE.failed`` (its JSON and the
    error, one line); the number of entries that failed is the exit status (capped at 100)."""
    path, index = argv[0], int(argv[1])
    done = Path(argv[3]) if len(argv) > 3 else None
    entries = load(Path(path))
    claims = _claims(path)
    claims.mkdir(exist_ok=True)
    failed = 0
    for k in [*range(index, len(entries)), *range(min(index, len(entries)))]:
        try:
            os.close(os.open(claims / str(k), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another worker's
        e = entries[k]
        try:
            compile_entry(e)
        except Exception as error:  # noqa: BLE001 - a stale entry must not stop the others
            failed += 1
            if done is not None:
                line = json.dumps({"entry": e, "error": f"{type(error).__name__}: {error}"[:2000]})
                with open(_failed_log(done), "a") as f:
                    f.write(line + "\n")
            continue
        if done is not None:
            with open(done, "a") as f:  # O_APPEND: lines of concurrent workers never interleave
                f.write(json.dumps(e, sort_keys=True) + "\n")
    return min(failed, 100)


def _kernel_name(text: str) -> str:
    """The kernel's name (its qualified name) in an entry's JSON text."""
    try:
        return json.loads(text)["fn"].partition(":")[2] or "?"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


def _claims(manifest: str | Path) -> Path:
    return Path(f"{manifest}.claims")


def _failed_log(done: Path) -> Path:
    return done.with_name(done.name + ".failed")


def worker_failures(done: Path) -> list[tuple[str, str]]:
    """``(kernel, error)`` of each entry a worker failed to compile (:func:`main`'s ``DONE.failed``)."""
    out = []
    try:
        lines = _failed_log(done).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
            out.append((record["entry"]["fn"], record["error"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
