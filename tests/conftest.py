import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from models import save_model  # noqa: E402

torch.set_num_threads(2)


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
