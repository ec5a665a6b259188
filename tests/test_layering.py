"""Dependencies run one way: _runtime <- _multi_tensor <- optim <- amp <- clients (the layer both
clients share) <- lightning, ultralytics, with graphs, losses and nn beside them; and no package
reads another's private members, nor torch's outside ``trainfuse._runtime.compat``. Read from the
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
    "clients": BASE | {"_multi_tensor", "optim", "amp", "clients"},
    "graphs": BASE | {"_multi_tensor", "optim", "amp", "losses", "nn", "graphs"},
    "lightning": BASE | {"_multi_tensor", "optim", "amp", "clients", "losses", "nn", "graphs",
                         "lightning"},
    "ultralytics": BASE | {"_multi_tensor", "optim", "amp", "clients", "losses", "nn", "graphs",
                           "ultralytics"},
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


# ---- private members -------------------------------------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(path: Path) -> set[str]:
    """Private names a module defines: its top-level functions, classes and variables, and the
    methods, class attributes and ``self._x`` attributes of its classes."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return {n for n in names if _private(n)}


OWNERS: dict[str, set[str]] = {}  # private name -> the packages that define it
for _module, _path in MODULES.items():
    for _name in _defined_private_names(_path) | ({_path.stem} if _private(_path.stem) else set()):
        OWNERS.setdefault(_name, set()).add(_package(_module) or "")


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reads(path: Path) -> list[tuple[int, str, str]]:
    """``(line, where, name)`` for every private attribute read on an object other than
    ``self``/``cls``, and every private name imported from a trainfuse module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            found.append((node.lineno, _root_name(base) or "?", node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainfuse"):
            found += [(node.lineno, node.module, a.name) for a in node.names if _private(a.name)]
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_member_of_another_package_is_read(module):
    """A private name read here is this package's own, or defined nowhere in trainfuse (then it
    is a dependency's, which the test below restricts to torch's compat module)."""
    package = _package(module) or ""
    bad = []
    for line, where, name in _private_reads(MODULES[module]):
        owners = OWNERS.get(name, set())
        if owners and package not in owners:
            bad.append(f"line {line}: {where}...{name} (defined in {', '.join(sorted(owners))})")
    assert not bad, f"{module} reads private members of other packages: {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "trainfuse._runtime.compat"))
def test_private_internals_of_dependencies_only_through_compat(module):
    """A private name that no trainfuse module defines belongs to torch, triton, Lightning or
    ultralytics: read only in trainfuse._runtime.compat, where a test pins each one."""
    # torch._foreach_* are the multi-tensor ops torch.optim is built on, documented beside torch's
    # other functions
    bad = [f"line {line}: {where}...{name}" for line, where, name in _private_reads(MODULES[module])
           if name not in OWNERS and not name.startswith("_foreach_")]
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not (node.module or "trainfuse").startswith("trainfuse"):
            bad += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if _private(a.name) or any(_private(part) for part in node.module.split("."))]
    assert not bad, f"{module} reads private internals of dependencies outside compat: {bad}"


def test_the_private_read_check_sees_reads():
    """The checks above are not vacuous: compat reads torch's privates, and a cross-package read
    written here is caught."""
    assert any(where == "torch" for _, where, _ in _private_reads(MODULES["trainfuse._runtime.compat"]))
    assert "_hot_plan" in OWNERS and "optim" in OWNERS["_hot_plan"]
