"""Shared fixtures. Tests are grouped by layer (unit/, kernels/, engine/, server/, gpu/);
helpers live in support/ (tests/ is on sys.path through pytest's `pythonpath`). A test that
needs CUDA carries `@pytest.mark.gpu` and nothing else: here it is skipped without a GPU, and
`pytest -m gpu` selects every GPU test."""

import os
import shutil
from collections.abc import Iterator

import pytest
import torch

from support.models import save_model

torch.set_num_threads(2)
# The exact path: `--dtype auto` on a CPU with bf16 instructions would pick bfloat16 (and the
# quantized GGUF layers); tests compare float32 with transformers. Server children inherit it.
os.environ["MINISGL_CPU_FLOAT32"] = "1"


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def minisgl_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Conversions (GGUF, packed layers) go to a cache of this session's, shared by its tests
    and the servers they start, never to the user's ~/.cache/minisgl."""
    cache = str(tmp_path_factory.mktemp("minisgl-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_CACHE_DIR", cache)
        yield cache
    shutil.rmtree(cache)  # the embedded model's conversion is 757 MB: pytest keeps temp dirs


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> (checkpoint dir, transformers model), built once per test session."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(arch))
            cache[arch] = (path, save_model(arch, path))
        return cache[arch]

    return get
