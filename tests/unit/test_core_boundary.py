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
