"""The project's import graph: no circles, and the product never imports its tools.

Read from the sources with ``ast`` (nothing is imported), counting every import, also
those inside functions: a lazy import still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("splitvl", "vlcommon", "gateway", "encoder_service", "cache_service", "decoder_service")
TOOLS = ("splitvl_tools",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in (*PRODUCT, *TOOLS):
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules that ``name`` imports (``from pkg import mod`` counts ``pkg.mod``)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".") if is_package else name.split(".")[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            # The longest known module the target names (a class in a module names it).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ importing its own submodules is not a circle.
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_checker_finds_a_circle_it_is_given() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_checker_resolves_relative_and_from_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from splitvl import launcher\nfrom vlcommon.errors import ServiceError\n"
        "def f():\n    import gateway.fetch\n"
    )
    known = {"splitvl", "splitvl.launcher", "vlcommon", "vlcommon.errors", "gateway.fetch"}
    assert _imports(src, "x.m", known) == {
        "splitvl",
        "splitvl.launcher",
        "vlcommon.errors",
        "gateway.fetch",
    }


def test_the_project_has_no_import_circle() -> None:
    graph = _graph()
    assert len(graph) > 40  # the walk found the project
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_product_never_imports_the_tools() -> None:
    graph = _graph()
    upward = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if name.split(".")[0] in PRODUCT
        for dep in deps
        if dep.split(".")[0] in TOOLS
    )
    assert upward == []
