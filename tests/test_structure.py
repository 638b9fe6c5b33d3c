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


# The layers, top to bottom: the public facades call the engine's ops, the ops run on the engine,
# everything moves data through the transport. (Modules not named here sit beside these layers:
# the helpers every layer may use, such as layout, partition, grid, blocks, validation.)
FACADES = {"credit_mpi.sharding", "credit_mpi.halo", "credit_mpi.grad_sync"}
ABOVE = ("credit_mpi.nn", "credit_mpi.io", "credit_mpi.cli")  # the layers, converters and tools built on the collectives


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that points up or sideways across the layers (empty when the layering holds)."""
    bad = []
    for name, targets in edges.items():
        for target in targets:
            if _in(name, ("credit_mpi.ops",)) and (target in FACADES or _in(target, ABOVE)):
                bad.append(f"{name} (an op) imports {target} (above the ops)")
            if name == "credit_mpi.engine" and (target in FACADES or _in(target, ABOVE + ("credit_mpi.ops",))):
                bad.append(f"{name} imports {target} (the engine knows no op and no facade)")
            if _in(name, ("credit_mpi.transport",)) and (
                target in FACADES or target == "credit_mpi.engine" or _in(target, ABOVE + ("credit_mpi.ops",))
            ):
                bad.append(f"{name} (transport) imports {target} (above the transport)")
    return sorted(bad)


def test_the_layer_checker_sees_an_upward_import():
    edges = {"credit_mpi.transport.moves": {"credit_mpi.engine"}, "credit_mpi.ops.gather": {"credit_mpi.nn.conv"},
             "credit_mpi.engine": {"credit_mpi.ops.halo"}, "credit_mpi.sharding": {"credit_mpi.engine"}}
    assert len(_layer_violations(edges)) == 3


def test_facades_over_ops_over_engine_over_transport():
    edges = graph()
    assert _layer_violations(edges) == []
    for facade in FACADES:  # each facade reaches its collectives through the engine
        assert "credit_mpi.engine" in edges[facade], facade
        assert any(_in(t, ("credit_mpi.ops",)) for t in edges[facade]), facade
    ops = [name for name in edges if name.startswith("credit_mpi.ops.") and name not in OP_HELPERS]
    # every op runs on the engine: directly, or through the op it declares a map of (group_rows: ops.rows' MoveRows)
    assert len(ops) >= 6 and all(_reaches_engine(name, edges) for name in ops), ops


OP_HELPERS = {"credit_mpi.ops.along"}  # the checks the ops share: no op of its own


def _reaches_engine(name: str, edges: dict[str, set[str]]) -> bool:
    """True when ``name`` imports the engine, directly or through other modules of credit_mpi.ops."""
    seen, todo = set(), [name]
    while todo:
        here = todo.pop()
        if "credit_mpi.engine" in edges.get(here, ()):
            return True
        seen.add(here)
        todo += [t for t in edges.get(here, ()) if _in(t, ("credit_mpi.ops",)) and t not in seen]
    return False


# -- private names stay inside their package ---------------------------------------------------------


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports(mods: dict[str, Path]) -> list[str]:
    """Every import of a private name (``_x``, or a name of a private module ``_m``) from another package."""
    bad = []
    for name, path in mods.items():
        package = _package_of(name, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                pairs = [(target, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                pairs = [tuple(alias.name.rsplit(".", 1)) for alias in node.names if "." in alias.name]
            else:
                continue
            for target, imported in pairs:
                if target.split(".")[0] != "credit_mpi":
                    continue
                full = f"{target}.{imported}"
                owner = target if target in mods and mods[target].name == "__init__.py" else target.rpartition(".")[0]
                inside = [p for p in full[len(owner) + 1 :].split(".") if p]  # the path below the target's package
                if owner != package and any(_private(p) for p in inside):
                    bad.append(f"{name} imports {full}")
    return sorted(bad)


def test_the_private_import_checker_sees_names_and_private_modules(tmp_path):
    pkg = tmp_path / "credit_mpi"
    (pkg / "nn").mkdir(parents=True)
    for rel in ("__init__.py", "nn/__init__.py", "nn/_comm.py", "nn/conv.py", "halo.py"):
        (pkg / rel).write_text("")
    (pkg / "nn" / "conv.py").write_text("from ._comm import agree\nfrom ..halo import _exchange\n")
    (pkg / "halo.py").write_text("from .nn import _comm\nfrom .nn._comm import agree\nimport credit_mpi.nn._comm\n")
    mods = {module_name_in(tmp_path, p): p for p in sorted(pkg.rglob("*.py"))}
    assert private_imports(mods) == [
        "credit_mpi.halo imports credit_mpi.nn._comm",
        "credit_mpi.halo imports credit_mpi.nn._comm",
        "credit_mpi.halo imports credit_mpi.nn._comm.agree",
        "credit_mpi.nn.conv imports credit_mpi.halo._exchange",
    ]


def module_name_in(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_another_packages_private_names():
    assert private_imports(modules()) == [], "private names imported across packages"


# -- the judge's rule registry --------------------------------------------------------------------------


def test_the_rule_registry_rejects_a_duplicate():
    import pytest

    from credit_mpi.nn.judge import DuplicateRule, registry, rule, wraps

    def again(tr, func, args, kwargs, held):
        return func(*args, **kwargs)

    with pytest.raises(DuplicateRule, match="'matmul' is registered twice"):
        rule("matmul")(again)  # the products' rule holds it (credit_mpi.nn.judge.reductions)
    with pytest.raises(DuplicateRule, match="'matmul' is registered twice"):
        wraps("matmul")(again)  # attention wraps it already
    with pytest.raises(DuplicateRule, match="named twice"):
        rule("credit_mpi_test_op", "credit_mpi_test_op")(again)
    assert registry.rule_for("credit_mpi_test_op") is None  # nothing of a refused registration is kept
    assert registry.rule_for("matmul").__doc__ == registry.rule_for("mm").__doc__  # wrapped, not replaced
