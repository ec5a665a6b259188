"""Compiling kernel specializations for a CUDA GPU this machine does not have.

The CPU tier drives every kernel through Triton's interpreter, which runs the kernel's Python on
NumPy arrays: a kernel the interpreter runs may still fail to compile for a GPU (a block shape or
a ``tl.dot`` size the code generator refuses, a type it cannot convert, more shared memory than
the GPU has). Triton needs no GPU to compile: its code generator, LLVM and ``ptxas`` ship with it.
This module compiles :mod:`~trainfuse._runtime.precompile` manifest entries (a kernel, what its
arguments specialize on, its constexprs and launch options) for a named CUDA architecture.

The entries come from a shipped manifest, from a machine's recorded ones, or from the CPU suite
itself: ``TRAINFUSE_KERNEL_MANIFEST=DIR python -m pytest`` writes one entry per specialization the
interpreter launched (``tests/_kernel_record.py``), then::

    python -m trainfuse._runtime.cross_compile DIR [--arch 90] [--jobs 2]

compiles each to a cubin, prints each kernel's registers, shared memory and spills (from the
cubin, ``cuobjdump -res-usage``) and the specializations that failed with their errors, and exits
with their count; ``--kernel NAME`` lists one kernel's specializations, with the widths of their
global loads and stores in the PTX (how far the accesses vectorized). It checks compiling,
nothing that running on the GPU would show (numerics, speed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainfuse._runtime import precompile

# torch dtype names (as manifest entries hold them) and Triton's pointer element types
_TRITON_TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
    "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}
_DIVISIBLE = [["tt.divisibility", 16]]
# constexprs that only the interpreter sets (its rounding and fused multiply-adds emulated by hand),
# and the value a GPU launch passes: an entry recorded under the interpreter compiles as the GPU's
INTERPRETER_ONLY = {"RNE": False, "UPCAST": False}
# sizes a kernel's host code picks otherwise under the interpreter (for the interpreter's speed),
# by kernel: the constexpr and where the GPU's value is ("module:name")
INTERPRETER_SIZES = {
    "trainfuse.ultralytics.augment.kernel:_augment_kernel": {
        "BLOCK": "trainfuse.ultralytics.augment.kernel:GPU_BLOCK"},
}


def as_on_gpu(e: dict) -> dict:
    """Entry ``e`` (recorded under the interpreter) with the constexprs a GPU launch passes
    instead of :data:`INTERPRETER_ONLY` and :data:`INTERPRETER_SIZES`."""
    consts = dict(e["constexprs"])
    consts.update((k, v) for k, v in INTERPRETER_ONLY.items() if k in consts)
    for name, where in INTERPRETER_SIZES.get(e["fn"], {}).items():
        if name in consts:
            consts[name] = precompile.resolve({"fn": where})
    return {**e, "constexprs": consts}


def source(e: dict):
    """Triton's compile input for entry ``e``: its kernel, the signature and the specialization
    attributes a launch with such arguments gets (16-byte aligned pointers and integers divisible
    by 16 marked so, integers equal to 1 made constants), its constexprs with the kernel's
    defaults for those the launch left out."""
    from triton.compiler import ASTSource

    fn = precompile.resolve(e)
    if not hasattr(fn, "params"):
        raise TypeError(f"{e['fn']} is the Triton interpreter's function here: compile with "
                        "TRITON_INTERPRET unset")
    given = precompile.constexprs_of(e)
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    signature, constants, attrs = {}, {}, {}
    args = iter(e["args"])
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            if p.name not in given and not p.has_default:
                raise ValueError(f"{e['fn']}: constexpr {p.name!r} has no value and no default")
            signature[p.name] = "constexpr"
            constants[(i,)] = given[p.name] if p.name in given else p.default
            continue
        spec = next(args)
        if spec[0] == "tensor":
            signature[p.name] = "*" + _TRITON_TYPES[spec[1]]
            if spec[2]:
                attrs[(i,)] = _DIVISIBLE
        elif spec[0] == "int":
            _, one, by16, wide = spec
            if one and p.name not in unspecialized:
                signature[p.name], constants[(i,)] = "constexpr", 1
                continue
            signature[p.name] = "i64" if wide else "i32"
            if by16 and p.name not in unspecialized:
                attrs[(i,)] = _DIVISIBLE
        else:
            signature[p.name] = "fp32"
    return ASTSource(fn, signature, constexprs=constants, attrs=attrs)


# shared memory a block may have, by compute capability (the opt-in maximum): a kernel compiled
# with more would fail to launch ("out of resource: shared memory") on that GPU
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def compile_for(e: dict, arch: int) -> dict:
    """Compile entry ``e`` for CUDA architecture ``arch`` (90: Hopper) down to its cubin; returns
    what the cubin says of it (:func:`resources`). Raises where its shared memory exceeds what a
    block of that architecture may have (the launch would fail)."""
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": e.get("num_warps", 4), **e.get("options", {})}
    kernel = triton.compile(source(e), target=GPUTarget("cuda", arch, 32), options=options)
    shared, limit = kernel.metadata.shared, SHARED_LIMIT.get(arch)
    if limit is not None and shared > limit:
        raise RuntimeError(f"out of resource: {shared} bytes of shared memory, sm_{arch} allows {limit}")
    return {"shared": shared, **resources(kernel.asm["cubin"]), **accesses(kernel.asm["ptx"])}


def accesses(ptx: str) -> dict:
    """The kernel's global loads and stores in its PTX by width (``ld``/``st``: ``{"v4.b32": 2,
    "b16": 8, ...}``): how far its accesses vectorized, counted in the code (each arm and unrolled
    copy once), not as executed."""
    out: dict[str, dict[str, int]] = {"ld": {}, "st": {}}
    for op, qualifiers in re.findall(r"\b(ld|st)\.global((?:\.[\w:]+)+)", ptx):
        parts = qualifiers.strip(".").split(".")
        width = ".".join(p for p in parts if re.fullmatch(r"v[248]|[bfsu](8|16|32|64|128)", p))
        out[op][width] = out[op].get(width, 0) + 1
    return out


def _cuobjdump() -> str | None:
    import triton.backends.nvidia as nvidia

    bundled = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


def resources(cubin: bytes) -> dict:
    """A kernel's registers per thread and its stack and local memory in bytes (spilled registers
    live there) as ``cuobjdump -res-usage`` reads them from the cubin (empty where it is missing)."""
    tool = _cuobjdump()
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if found is None:
        return {}
    reg, stack, _, local = (int(v) for v in found.groups())
    return {"registers": reg, "stack": stack, "local": local}


def entries_in(path: Path) -> list[dict]:
    """The distinct entries of a manifest file, or of every ``*.json`` manifest under a folder, as
    a GPU launches them (:func:`as_on_gpu`)."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    seen: dict[str, dict] = {}
    for f in files:
        for e in precompile.load(f):
            if e["fn"].startswith("tests."):  # the suite's own probe kernels (and importing the
                continue  # tests' conftest switches the interpreter on in this process)
            e = as_on_gpu(e)
            seen.setdefault(json.dumps(e, sort_keys=True), e)
    return list(seen.values())


def _one(args: tuple[dict, int]) -> tuple[dict, dict | str]:
    e, arch = args
    try:
        return e, compile_for(e, arch)
    except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the others
        return e, f"{type(error).__name__}: {error}".strip()[:4000]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainfuse._runtime.cross_compile",
                                     description="compile manifest entries for a CUDA GPU, no GPU needed")
    parser.add_argument("manifest", type=Path, help="a manifest file, or a folder of them")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, 90 for sm_90")
    parser.add_argument("--jobs", type=int, default=1, help="compiling processes")
    parser.add_argument("--kernel", default=None, help="list this kernel's specializations one by one")
    args = parser.parse_args(argv)
    entries = entries_in(args.manifest)
    if not entries:
        print(f"no manifest entries in {args.manifest}")
        return 1
    work = [(e, args.arch) for e in entries]
    if args.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_one, work))
    else:
        results = [_one(w) for w in work]
    failed = [(e, r) for e, r in results if isinstance(r, str)]
    kernels = {e["fn"] for e in entries}
    print(f"{len(entries) - len(failed)} of {len(entries)} specializations of {len(kernels)} kernels "
          f"compiled for sm_{args.arch}")
    usage: dict[str, list[dict]] = {}
    for e, r in results:
        if not isinstance(r, str) and r.get("registers") is not None:
            usage.setdefault(e["fn"].partition(":")[2], []).append(r)
    if usage:
        print("kernel: specializations, registers per thread (most), shared bytes (most), spilled "
              "(stack or local memory)")
        for name, rs in sorted(usage.items()):
            spilled = sum(1 for r in rs if r["stack"] or r["local"])
            print(f"  {name}: {len(rs)}, {max(r['registers'] for r in rs)}, {max(r['shared'] for r in rs)}, "
                  f"{spilled}")
    for e, r in results:
        if args.kernel is not None and e["fn"].partition(":")[2] == args.kernel and not isinstance(r, str):
            consts = ", ".join(f"{k}={v}" for k, v in sorted(e["constexprs"].items()))
            print(f"  {args.kernel}({consts}; num_warps={e.get('num_warps')}): {r}")
    for e, error in failed:
        consts = ", ".join(f"{k}={v}" for k, v in sorted(e["constexprs"].items()))
        print(f"FAILED {e['fn']} ({consts}; num_warps={e.get('num_warps')})\n    "
              + error.replace("\n", "\n    "))
    return min(len(failed), 100)


if __name__ == "__main__":
    sys.exit(main())
