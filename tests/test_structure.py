"""The package's structure: imports point down, and the API reference shows each public name once.

Every ``import`` of one credit_mpi module by another, at any depth (inside
functions too), is an edge of a graph that must have no cycle: an import
inside a function may delay loading torch, CuPy or matplotlib, but never
dodge a cycle between credit_mpi's own modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import credit_mpi

PACKAGE = Path(credit_mpi.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The credit_mpi modules that ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "credit_mpi")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "credit_mpi":
                continue
            for alias in node.names:  # `from . import halo` imports the module credit_mpi.halo
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    found.discard(name)
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_checker_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from . import halo\n    from ..validation import agree\n")
    known = {"credit_mpi.validation", "credit_mpi.sub", "credit_mpi.sub.halo", "credit_mpi.sub.x"}
    assert imports_of("credit_mpi.sub.x", path, known) == {"credit_mpi.sub.halo", "credit_mpi.validation"}


def test_no_import_cycle_between_credit_mpi_modules():
    edges = graph()
    assert len(edges) > 10 and any(edges.values())  # the checker really read the package
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
