"""Dependencies run one way: _runtime <- _multi_tensor <- optim <- amp <- clients (lightning,
ultralytics, graphs), with losses and nn beside the optimizers on the runtime alone. Read from the
source with ``ast``: every import counts, inside functions and under ``TYPE_CHECKING`` too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "trainfuse"

# package -> the trainfuse packages its modules may import (itself included)
BASE = {"_runtime"}
ALLOWED = {
    "_runtime": BASE,
    "_multi_tensor": BASE | {"_multi_tensor"},
    "losses": BASE | {"losses"},
    "nn": BASE | {"nn"},
    "optim": BASE | {"_multi_tensor", "optim"},
    "amp": BASE | {"_multi_tensor", "optim", "amp"},
    "graphs": BASE | {"_multi_tensor", "optim", "amp", "losses", "nn", "graphs"},
    "lightning": BASE | {"_multi_tensor", "optim", "amp", "losses", "nn", "graphs", "lightning"},
    "ultralytics": BASE | {"_multi_tensor", "optim", "amp", "losses", "nn", "graphs", "ultralytics"},
}
# the top-level package and the demo: everything but the optional integrations
TOP = {"_runtime", "_multi_tensor", "optim", "amp", "losses", "nn", "graphs"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module a dotted import lands in: the longest prefix that is a module of ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import submodule`` imports the submodule (its package is always set up
            # first, whoever asks); ``from module import name`` imports the module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for n in names:
            if n == "trainfuse" or n.startswith("trainfuse."):
                target = _resolve(n)
                if target and target != module:
                    found.add(target)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (ROOT / parts[1]).is_dir() else None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_only_downward(module):
    package = _package(module)
    if package == "bench":  # the benchmarks measure everything
        return
    allowed = ALLOWED.get(package, TOP) if package else TOP
    bad = sorted(t for t in GRAPH[module] if t != "trainfuse" and _package(t) not in allowed)
    assert not bad, f"{module} (package {package}) imports upward or sideways: {bad}"


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in GRAPH.get(m, ()):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_graph_is_read():
    """The checks above see real edges: the optimizers import the multi-tensor tables."""
    assert "trainfuse._multi_tensor.tables" in GRAPH["trainfuse.optim.engine"]
    assert "trainfuse._runtime.launch" in GRAPH["trainfuse._multi_tensor.tables"]
