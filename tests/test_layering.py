"""Dependencies run one way: _runtime <- _multi_tensor <- optim <- amp <- clients (the layer both
clients share) <- lightning, ultralytics, with graphs, losses and nn beside them; the ops
(``losses``, ``nn``) import no integration's framework; no package reads another's private
members, and a dependency's private names (torch's, Lightning's, ultralytics') are read or
overridden only in that dependency's compat module. Imports and reads are read from the source
with ``ast`` (every import counts, inside functions and under ``TYPE_CHECKING`` too); overrides and
``self.`` reads of a dependency's private members from the classes themselves."""

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


# each dependency's private names live in one module, where a test pins each one
COMPAT = {"trainfuse._runtime.compat": "torch and triton", "trainfuse.lightning._compat": "Lightning",
          "trainfuse.ultralytics.compat": "ultralytics"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in COMPAT))
def test_private_internals_of_dependencies_only_through_compat(module):
    """A private name that no trainfuse module defines belongs to torch, triton, Lightning or
    ultralytics: read only in their compat modules (:data:`COMPAT`)."""
    # torch._foreach_* are the multi-tensor ops torch.optim is built on, documented beside torch's
    # other functions; os._exit is the standard library's documented exit without teardown
    bad = [f"line {line}: {where}...{name}" for line, where, name in _private_reads(MODULES[module])
           if name not in OWNERS and not name.startswith("_foreach_") and (where, name) != ("os", "_exit")]
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


# ---- the ops import no integration's framework ---------------------------------------------------------
FRAMEWORKS = ("ultralytics", "lightning", "pytorch_lightning")


def _external_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _package(m) in ("losses", "nn")))
def test_ops_import_no_framework(module):
    """The kernels and their math (``trainfuse.losses``, the detection loss's ops included, and
    ``trainfuse.nn``) import neither ultralytics nor Lightning: the integrations tie them in."""
    bad = sorted(_external_imports(MODULES[module]) & set(FRAMEWORKS))
    assert not bad, f"{module} imports {bad}"


# ---- overrides and self reads of a dependency's private members ---------------------------------------
def _dependency_private_members(cls: type) -> dict[str, str]:
    """Private member name -> the dependency class that defines it, over ``cls``'s bases from
    outside trainfuse (``object`` aside)."""
    found = {}
    for base in cls.__mro__[1:]:
        if base is object or base.__module__.split(".")[0] == "trainfuse":
            continue
        for name in vars(base):
            if _private(name):
                found.setdefault(name, f"{base.__module__}.{base.__qualname__}")
    return found


def _class_source(cls: type) -> ast.ClassDef | None:
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return None
    return next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)


def _body_names(node: ast.ClassDef) -> set[str]:
    """The names the class body itself defines (methods, class attributes)."""
    names = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _self_reads(node: ast.ClassDef) -> set[str]:
    """Private attributes the class's own code reads or calls on ``self``, ``cls`` or ``super()``."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and _private(n.attr):
            base = n.value
            on_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
            on_super = isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super"
            if on_self or on_super:
                names.add(n.attr)
    return names


def _pinned() -> set[str]:
    """Private state of torch's GradScaler that ``trainfuse.amp.GradScaler``, its subclass, reads
    as its own: named in torch's compat module and pinned there by a test."""
    from trainfuse._runtime import compat

    return set(compat.GRAD_SCALER_STATE)


def private_dependency_uses(cls: type) -> list[str]:
    """Where ``cls``'s body overrides, or its code reads through ``self``/``super()``, a private
    member that one of its bases from a dependency defines (what a compat module may do, and
    nothing else; the names a compat module pins as a subclass's own state aside)."""
    node = _class_source(cls)
    if node is None:
        return []
    members = {k: v for k, v in _dependency_private_members(cls).items() if k not in _pinned()}
    own = {n for n in _body_names(node) if _private(n)}
    uses = [f"{cls.__name__} overrides {members[n]}.{n}" for n in sorted(own & members.keys())]
    uses += [f"{cls.__name__} reads {members[n]}.{n}" for n in sorted(_self_reads(node) & members.keys())
             if n not in own]
    return uses


def _classes_of(module: str) -> list[type]:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # an optional integration whose framework is not installed
        pytest.skip(f"{module}: {e}")
    return [obj for obj in vars(mod).values() if isinstance(obj, type) and obj.__module__ == module]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in COMPAT and _package(m) != "bench"))
def test_private_members_of_dependencies_are_overridden_only_in_compat(module):
    """No class outside the compat modules overrides a dependency's private method (a subclass's
    ``def _setup_train``) or reads one of its private members through ``self`` or ``super()``:
    those contracts with a dependency's internals sit in its compat module, pinned by tests."""
    bad = [use for cls in _classes_of(module) for use in private_dependency_uses(cls)]
    assert not bad, f"{module}: {bad}"


def test_the_override_check_sees_a_planted_private_override():
    """The check above is not vacuous: a trainer subclass overriding ultralytics' private
    ``_setup_train`` is caught, as is a ``self._`` read of torch's Optimizer internals."""
    import torch

    class Planted(torch.optim.SGD):
        def _patch_step_function(self):
            return self._zero_grad_profile_name

    assert private_dependency_uses(Planted) == [
        "Planted overrides torch.optim.optimizer.Optimizer._patch_step_function"]
    pytest.importorskip("ultralytics")
    from ultralytics.models.yolo.detect import DetectionTrainer

    class PlantedTrainer(DetectionTrainer):
        def _setup_train(self):
            super()._setup_train()
            return self._do_train

    uses = private_dependency_uses(PlantedTrainer)
    assert any(u.startswith("PlantedTrainer overrides ultralytics.") and u.endswith("._setup_train")
               for u in uses)
    assert any(u.endswith("._do_train") and " reads " in u for u in uses)
