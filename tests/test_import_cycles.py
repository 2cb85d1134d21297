"""No module of the package imports itself back through others.

A static check of the source: every import of one of our modules counts,
those inside functions too (a cycle hidden behind a deferred import is still a
cycle between the layers of docs/architecture.md), except under ``if TYPE_CHECKING:``,
which never runs. Importing a submodule also runs its package's ``__init__``;
that edge is left out, or every package would import itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the import package it installs as (pyproject.toml's package-dir).
PACKAGES = {ROOT / "torch_moe_ops": "torch_moe_ops", ROOT / "lowering": "torch_moe_ops.lowering"}


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules among ``modules`` that module ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    pending = [ast.parse(path.read_text())]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            # `from a import b` imports the module a.b where there is one, else a.
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
        pending.extend(child for child in ast.iter_child_nodes(node)
                       if not _type_checking_only(child))
    return (found & modules.keys()) - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    done, path = set(), []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            if (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if (cycle := visit(name)) is not None:
            return cycle
    return None


def test_the_checker_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_checker_reads_our_imports():
    modules = _modules()
    imported = _imports("torch_moe_ops.layer", modules["torch_moe_ops.layer"], modules)
    assert {"torch_moe_ops.config", "torch_moe_ops.quant", "torch_moe_ops.backends"} <= imported


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycle = _cycle(graph)
    assert cycle is None, ("modules must not import each other in a cycle (move what both "
                           "need to a module of its own, or import it for typing only under "
                           f"`if TYPE_CHECKING:`), got {' -> '.join(cycle)}")
