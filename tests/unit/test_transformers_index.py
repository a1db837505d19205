"""ext/perf/transformers_index.py: transformers' index of its lazy modules, built once and read
from MINISGL_CACHE_DIR after (the `before_transformers` point), is the index transformers builds."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from support.server import REPO

pytestmark = pytest.mark.ext

# A server process's first import (`transformers_without_torch`, which calls the point), then
# the index transformers' modules got compared with one built here without the cache.
SCRIPT = """
import os, sys
from pathlib import Path
from minisgl.models.hf import transformers_without_torch
transformers_without_torch()
import transformers
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import import_utils
models = Path(transformers.__file__).parent / "models"
built = import_utils.spread_import_structure(import_utils.create_import_structure_from_path(models))
cached = import_utils.define_import_structure(models)
assert cached == built, "the index read from the cache differs from transformers' own"
assert AutoConfig.__name__ == "AutoConfig" and "qwen3" in dir(transformers.models)
print(import_utils.define_import_structure.__name__, len(built))
"""


def run(cache: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), MINISGL_CACHE_DIR=cache)
    env.pop("MINISGL_DISABLE_EXTENSIONS", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def stamps(folder: str) -> dict[str, int]:
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)}


def test_a_process_builds_the_index_once_and_the_next_reads_it(tmp_path: Any) -> None:
    cache = str(tmp_path / "cache")
    first = run(cache)
    assert first.startswith("define_import_structure ")  # the wrapper, not transformers' own
    folder = os.path.join(cache, "transformers")
    written = stamps(folder)
    assert written and all(n.startswith("index-") and n.endswith(".pickle") for n in written)
    assert run(cache) == first
    assert stamps(folder) == written  # read, not written again


def test_built_once_per_folder_state_and_without_a_usable_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minisgl.ext.perf.transformers_index import on_disk

    calls: list[tuple[Any, Any]] = []

    def build(path: Any, prefix: Any = None) -> dict[Any, Any]:
        calls.append((path, prefix))
        return {frozenset({"tokenizers"}): {"a.b": {"C", str(len(calls))}}}

    indexed = tmp_path / "models"
    indexed.mkdir()
    (indexed / "x.py").write_text("__all__ = ['C']\n")
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    index = on_disk(build)
    first = index(str(indexed), "models")
    assert index(str(indexed), "models") == first and len(calls) == 1
    assert index(str(indexed / "x.py")) != first and len(calls) == 2  # another path and prefix
    (indexed / "y.py").write_text("")  # another state of the folder: built again
    assert index(str(indexed), "models") != first and len(calls) == 3
    assert not [n for n in os.listdir(tmp_path / "cache" / "transformers") if "tmp" in n]
    # a cache that cannot be written: built each time, as without it
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "file"))
    assert index(str(indexed), "models") == {frozenset({"tokenizers"}): {"a.b": {"C", "4"}}}
    assert len(calls) == 4
