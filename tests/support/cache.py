"""The native CPU kernels (`minisgl/ext/cpu/native.py`) built once for a whole test run: every
MINISGL_CACHE_DIR the tests make (each worker's session cache, a test's own, an inner pytest's)
holds `kernels/` as a link to one folder of the run, named by KERNELS_ENV (inherited by the
servers and subprocesses the tests start), so a process that needs the kernels loads what
another built (~10 s of one core a build: a fresh cache built them again in every pytest
worker, every test with a cache of its own and every inner pytest run; and a first GGUF
conversion in a cache without them starts a build). A build holds the folder's lock, so a
second process waits for it; the tests of the build itself (test_native_kernel's
`fresh_kernel`) use a cache without the link. The same for
transformers' index of its modules (`minisgl/ext/perf/transformers_index.py`, ~0.6 s of CPU in
each process of a server's first start with a fresh cache): `transformers/`, linked to a folder
beside the kernels' (test_transformers_index's caches have no link)."""

from __future__ import annotations

import os

KERNELS_ENV = "MINISGL_TESTS_KERNELS"


def shared_kernels(basetemp: str) -> str:
    """The run's kernels folder: the inherited one (an inner pytest), else one beside the
    pytest workers' base temporary folders (`basetemp`: this process's)."""
    if inherited := os.environ.get(KERNELS_ENV):
        return inherited
    root = os.path.dirname(basetemp) if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    return os.path.join(root, "kernels")


def link_kernels(cache: str | os.PathLike[str]) -> str:
    """`cache` (created if absent) with `kernels/` and `transformers/` linked to the run's
    folders; `cache` as str."""
    shared = os.environ[KERNELS_ENV]  # set by tests/conftest.py's minisgl_cache
    index = os.path.join(os.path.dirname(shared), "transformers-index")
    os.makedirs(cache, exist_ok=True)
    for name, folder in (("kernels", shared), ("transformers", index)):
        os.makedirs(folder, exist_ok=True)  # a link to no folder would fail a build's makedirs
        os.symlink(folder, os.path.join(cache, name))
    return str(cache)
