"""The core never imports an extension: `minisgl.ext` is found only through
`minisgl.extension.extensions()`, which tolerates its absence (issue 46)."""

from __future__ import annotations

import ast
import os

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "python", "minisgl")


def core_files() -> list[str]:
    files = []
    for root, dirs, names in os.walk(PACKAGE):
        dirs[:] = [
            d for d in dirs if d != "ext" or os.path.abspath(root) != os.path.abspath(PACKAGE)
        ]
        files += [os.path.join(root, n) for n in names if n.endswith(".py")]
    return files


def ext_imports(path: str) -> list[str]:
    """`import minisgl.ext...` and `from minisgl.ext... import`/`from minisgl import ext`, with
    their line numbers, anywhere in the file (inside functions and TYPE_CHECKING too)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n == "minisgl.ext" or n.startswith("minisgl.ext.") for n in names):
            found.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}")
    return found


def test_no_module_of_the_core_imports_an_extension() -> None:
    files = core_files()
    assert len(files) > 50  # the walk found the package
    offenders = [hit for path in files for hit in ext_imports(path)]
    assert offenders == []


def test_the_check_sees_an_import(tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from minisgl.ext.structured import x\nimport minisgl.ext\n")
    assert len(ext_imports(str(path))) == 2


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")]
    return rel.replace(os.sep, ".").removesuffix(".__init__")


def imports_of(path: str, package: str, known: set[str]) -> set[str]:
    """The known modules a file imports anywhere (module level, functions, TYPE_CHECKING);
    `from minisgl import kernel` names the submodule, not the package."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package upwards
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & known
            found |= subs or {base}
    return found & known


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the import graph (a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_core_has_no_import_circle() -> None:
    """Issue 46: no runtime or type-level circle among the core's modules (kernel/ included)."""
    files = {module_name(p): p for p in core_files()}
    known = set(files)
    graph = {}
    for name, path in files.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        graph[name] = imports_of(path, package, known) - {name}
    assert "minisgl.core" in graph and graph["minisgl.engine.engine"]  # the walk saw them
    assert import_cycle(graph) is None


def test_the_cycle_check_sees_a_circle() -> None:
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None
