"""ruff keeps the style (pyproject.toml's [tool.ruff]): the lint rules pass and the code is formatted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIRS = ["."]  # every Python file of the project (pyproject.toml leaves the Markdown out)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(command):
    ran = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *DIRS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-1000:]


def _imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package under ``root`` and the package's modules it imports, at the
    top or inside a function (not under TYPE_CHECKING: those never run); importing a submodule
    imports its packages too (but for the module's own, already set up); a compiled extension is
    no module here, so no edge."""
    import ast

    mods = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package[: len(package) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem for a in node.names]
            own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 1)}
            for t in targets:
                while t:  # the module and every package above it (its own packages are set up)
                    if t in mods and t != name and t not in own:
                        deps.add(t)
                    t = t.rpartition(".")[0]
        graph[name] = deps
    return graph


def test_no_module_of_umopt_imports_itself_back():
    """Data flows one way: no import cycle among umopt's modules, top-level or inside a function."""
    graph = _imports(ROOT / "umopt")
    reach = {m: set(d) for m, d in graph.items()}
    changed = True
    while changed:  # the transitive closure (a few hundred edges)
        changed = False
        for m, r in reach.items():
            more = set().union(*(reach[d] for d in r)) - r
            if more:
                r |= more
                changed = True
    cycles = sorted(m for m, r in reach.items() if m in r)
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_no_package_of_umopt_imports_itself_back():
    """Between umopt's packages (a folder, or a module at its top) the data flows one way too:
    measuring a profile uses neither the runtime nor the search (the probe runs that do are
    umopt.probes, above both), and the runtime and the profiler share the split backward from
    below. Cycles are named by the packages on them."""
    graph = _imports(ROOT / "umopt")

    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for m, deps in graph.items():
        edges.setdefault(package(m), set()).update(package(d) for d in deps if package(d) != package(m))
    reach = {p: set(d) for p, d in edges.items()}
    changed = True
    while changed:
        changed = False
        for p, r in reach.items():
            more = set().union(*(reach.get(d, set()) for d in r)) - r
            if more:
                r |= more
                changed = True
    cycles = {
        frozenset(q for q in reach if p in reach[q] and q in reach[p]) | {p} for p in reach if p in reach[p]
    }
    assert not cycles, f"packages on an import cycle: {sorted(map(sorted, cycles))}"
    assert "umopt.run" not in reach["umopt.measure"] and "umopt.search" not in reach["umopt.measure"]


def test_every_package_of_umopt_is_installed():
    """pyproject lists umopt's packages by name: one left out installs without it (an editable
    install does not show it; ``pip install .`` does, at the first import)."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "umopt").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"


def test_the_commands_parse_call_and_print():
    """cli/ prints what the library decided: no function there over 60 lines (the decisions, checks
    and solve paths live in umopt/, e.g. umopt.search.ask for ``umopt solve``)."""
    import ast

    root = Path(__file__).resolve().parent.parent / "cli"
    long = [
        f"{p.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for p in sorted(root.glob("*.py"))
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 60
    ]
    assert not long, f"over 60 lines: {long}"


def test_the_benches_and_examples_import_what_exists():
    """Every ``from umopt... import name`` of bench/, examples/ and the docs' snippets names a
    module and a name that exist: a move in umopt/ that left one behind fails here, not on the next
    GPU or in a reader's hands."""
    import ast
    import importlib

    root = Path(__file__).resolve().parent.parent
    missing = []
    for path in sorted([*(root / "bench").glob("*.py"), *(root / "examples").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "umopt":
                try:
                    module = importlib.import_module(node.module)
                except ImportError as exc:
                    missing.append(f"{path.name}: {node.module} ({exc})")
                    continue
                missing += [
                    f"{path.name}: {node.module}.{a.name}"
                    for a in node.names
                    if not hasattr(module, a.name) and not _is_module(f"{node.module}.{a.name}")
                ]
    import re

    for path in sorted([*(root / "docs").glob("*.md"), root / "README.md"]):  # the docs' snippets too
        for module, names in re.findall(r"^\s*from (umopt[\w.]*) import ([\w, ]+)$", path.read_text(), re.M):
            try:
                found = importlib.import_module(module)
            except ImportError as exc:
                missing.append(f"{path.name}: {module} ({exc})")
                continue
            missing += [
                f"{path.name}: {module}.{n.strip()}"
                for n in names.split(",")
                if not hasattr(found, n.strip())
            ]
    assert not missing, f"imports of things that are not there: {missing}"


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False
