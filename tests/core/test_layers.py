"""The import layering, checked on the source: core < viz, calibrate (peers) < cli, and no import cycles.

Every module of the three source folders is parsed with ``ast``; every import counts, including those inside
functions (they run too, only later). Imports under ``if TYPE_CHECKING:`` never run and are left out.

- core: ``ppsim.*`` (including ``ppsim.schedules``) except the three below. It imports no torch, torchtitan,
  matplotlib or plotly.
- ``ppsim.viz`` (``viz/``) and ``ppsim.calibrate`` (``calibrate/``): peers above the core; neither imports the other.
- ``ppsim.cli``: the command line, the only layer allowed to import every other one.

A cycle is a set of modules that import each other; the one pattern allowed is a package's ``__init__`` importing its
own modules (a registry loading its entries, which import the registry back).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = {"ppsim": REPO / "ppsim", "ppsim.viz": REPO / "viz", "ppsim.calibrate": REPO / "calibrate"}
LAYER = {"core": 0, "viz": 1, "calibrate": 1, "cli": 2}
CORE_FORBIDDEN = ("torch", "torchtitan", "matplotlib", "plotly")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int


def find_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = find_modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path) -> list[Import]:
    """Every import ``name`` executes at some point (module level or in a function), resolved to module names."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(name, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node)
            for alias in node.names:
                full = f"{module}.{alias.name}"
                found.append(Import(name, full if full in MODULES else module, node.lineno))
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return found


def layer_of(module: str) -> str:
    for prefix, layer in (("ppsim.cli", "cli"), ("ppsim.viz", "viz"), ("ppsim.calibrate", "calibrate")):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "core"


def internal_target(target: str) -> str | None:
    """The project module an import names (``ppsim.costs.parse_costs`` -> ``ppsim.costs``), or None if external."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def all_imports() -> list[Import]:
    return [imp for name, path in MODULES.items() for imp in imports_of(name, path)]


def layering_violations(imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        src = layer_of(imp.source)
        target = internal_target(imp.target)
        if target is None:
            if src == "core" and imp.target.split(".")[0] in CORE_FORBIDDEN:
                problems.append(f"{imp.source}:{imp.line} imports {imp.target} (core imports no {imp.target})")
            continue
        dst = layer_of(target)
        if LAYER[dst] > LAYER[src]:
            problems.append(f"{imp.source}:{imp.line} imports {target} ({src} may not import {dst})")
        elif LAYER[dst] == LAYER[src] and dst != src:
            problems.append(f"{imp.source}:{imp.line} imports {target} ({src} and {dst} are peers)")
    return problems


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected sets of modules (more than one), ignoring a package importing its own modules."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for imp in imports:
        target = internal_target(imp.target)
        if target is None or target == imp.source:
            continue
        if target.startswith(imp.source + ".") and MODULES[imp.source].name == "__init__.py":
            continue  # a package loading its own modules
        graph[imp.source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_every_source_folder_has_modules() -> None:
    for package in SOURCES:
        assert any(layer_of(m) == layer_of(package) for m in MODULES), package
    assert "ppsim.cli" in MODULES and "ppsim.schedules.dualpipev" in MODULES


def test_no_module_imports_a_layer_above_it_or_a_peer() -> None:
    assert layering_violations(all_imports()) == []


def test_no_import_cycles() -> None:
    assert import_cycles(all_imports()) == []


# --- the checker itself catches what it should ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "target", "rule"),
    [
        ("ppsim.simulator", "ppsim.viz.gantt", "core may not import viz"),
        ("ppsim.costs", "ppsim.cli", "core may not import cli"),
        ("ppsim.calibrate.calibrate_cmd", "ppsim.cli.fmt_bytes", "calibrate may not import cli"),
        ("ppsim.viz.report", "ppsim.calibrate.execute.executor", "viz and calibrate are peers"),
        ("ppsim.result", "matplotlib.pyplot", "core imports no matplotlib.pyplot"),
        ("ppsim.schedules.zbv", "torch", "core imports no torch"),
    ],
)
def test_checker_flags_upward_and_peer_imports(source: str, target: str, rule: str) -> None:
    (problem,) = layering_violations([Import(source, target, 1)])
    assert rule in problem


def test_checker_allows_downward_imports() -> None:
    allowed = [Import("ppsim.cli.simulation", "ppsim.viz.report", 1), Import("ppsim.viz.gantt", "ppsim.io", 1),
               Import("ppsim.calibrate.run_cmd", "ppsim.simulator", 1), Import("ppsim.simulator", "numpy", 1)]
    assert layering_violations(allowed) == []


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    source = "def f():\n    from ppsim.simulator import simulate\n"
    path = tmp_path / "x.py"
    path.write_text(source)
    found = imports_of("ppsim.costs", path)
    assert Import("ppsim.costs", "ppsim.simulator", 2) in found
    cycles = import_cycles([*found, Import("ppsim.simulator", "ppsim.costs", 1)])
    assert ["ppsim.costs", "ppsim.simulator"] in cycles


def test_checker_skips_type_checking_imports(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ppsim.viz import gantt\n")
    assert [i.target for i in imports_of("ppsim.result", path)] == ["typing"]
