"""transformers' index of its lazy modules, kept on disk (the `before_transformers` point).

At `import transformers` its `define_import_structure` reads each of its ~3,000 model files for
the names they export, twice (`transformers` and `transformers.models` each ask: ~0.6 s of CPU,
a third of what the tokenizer worker and the detokenizer spend to start, issue 47). `install`,
called before the import, gives that function a cache in MINISGL_CACHE_DIR/transformers: the
index is built once per module path, prefix and state of the folder indexed (its entries' names
and modification times: another version of transformers, installed over it, builds it again).
Without it (or MINISGL_DISABLE_EXTENSIONS=1) transformers builds the index at each import; the
index is the same."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

INDEXER = "transformers.utils.import_utils"  # where `define_import_structure` is defined


class IndexOnDisk:
    """A finder that changes nothing but, once: as INDEXER loads, its `define_import_structure`
    is wrapped by `on_disk` (transformers' own modules take the wrapped one)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != INDEXER:
            return None
        sys.meta_path.remove(self)  # once, and not for the look-up below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if callable(build := getattr(module, "define_import_structure", None)):
                module.define_import_structure = on_disk(build)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Before transformers' first import in this process (after it: nothing to do)."""
    if INDEXER not in sys.modules and not any(isinstance(f, IndexOnDisk) for f in sys.meta_path):
        sys.meta_path.insert(0, IndexOnDisk())


def index_file(path: Any, prefix: str | None) -> str:
    """The cache file of `build(path, prefix)`, named by them and the indexed folder's state."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    with os.scandir(folder) as entries:
        state = sorted((e.name, e.stat().st_mtime_ns) for e in entries)
    key = hashlib.sha256(repr((os.fspath(path), prefix, state)).encode()).hexdigest()[:24]
    from minisgl.ext.cpu.gguf import cache_root

    return os.path.join(cache_root(), "transformers", f"index-{key}.pickle")


def on_disk(build: Callable[..., Any]) -> Callable[..., Any]:
    """`build(path, prefix)` read from its cache file, or built and written there (a temporary
    file renamed: processes starting together may both build it; a cache that cannot be read
    or written is built as without it)."""

    def define_import_structure(path: Any, prefix: str | None = None) -> Any:
        try:
            file = index_file(path, prefix)
        except OSError:
            return build(path, prefix)
        with contextlib.suppress(Exception), open(file, "rb") as f:
            return pickle.load(f)
        index = build(path, prefix)
        temp = f"{file}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(file), exist_ok=True)
            with open(temp, "wb") as f:
                pickle.dump(index, f)
            os.replace(temp, file)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(temp)
        return index

    return define_import_structure
