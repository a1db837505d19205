"""The processes that run no model never import torch (issue 47: ~2 s and ~190 MB each at
every start): a tokenizer worker, the detokenizer and the API process (`python -m minisgl`'s
main process) import their modules, load the registry of the extensions and tokenize, render
chat templates and detokenize with torch's import refused. The scheduler's parts that the
extensions register are imported when a scheduler makes them (`ext/lazy.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from minisgl import extension
from support.server import REPO
from support.tokenizer import build_tiny_tokenizer

# Run in a fresh interpreter: torch's import raises, naming who asked (a lookup of torch's spec
# by transformers' availability check is answered "absent" by `transformers_without_torch`).
SCRIPT = """
import sys, traceback

class RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported by a process without a model")

sys.meta_path.insert(0, RefuseTorch())
from minisgl.models.hf import transformers_without_torch
transformers_without_torch()  # as __main__ and the workers do first
import minisgl.__main__, minisgl.message, minisgl.core
import minisgl.server.args, minisgl.server.launch, minisgl.server.api_server
import minisgl.server.frontend, minisgl.server.gate
import minisgl.tokenizer.server, minisgl.tokenizer.detokenize
from minisgl.extension import extensions
from minisgl.core import SamplingParams
from minisgl.server.args import parse_args
from minisgl.tokenizer.detokenize import request_detokenizer
from minisgl.tokenizer.server import load_chat_tokenizer

exts = extensions()
params = {"temperature": 0.5, **({"logprobs": 2, "min_tokens": 2} if exts.loaded else {})}
SamplingParams(**params)
parse_args(["--model", sys.argv[1]])
tok = load_chat_tokenizer(sys.argv[1], None)
ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
detok = request_detokenizer(tok, [], True, ["zz"], params.get("min_tokens", 0))
print("loaded" if exts.loaded else "core", "torch" in sys.modules)
"""


def run_light(model: str, core_alone: bool) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    env.pop("MINISGL_DISABLE_EXTENSIONS", None)
    if core_alone:
        env["MINISGL_DISABLE_EXTENSIONS"] = "1"
    cmd = [sys.executable, "-c", SCRIPT, model]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tok"))
    build_tiny_tokenizer(path)
    return path


def test_the_core_alone_imports_no_torch_in_light_processes(tokenizer_dir: str) -> None:
    assert run_light(tokenizer_dir, core_alone=True) == "core False"


@pytest.mark.ext
def test_the_extensions_import_no_torch_in_light_processes(tokenizer_dir: str) -> None:
    assert run_light(tokenizer_dir, core_alone=False) == "loaded False"


def lazy_values(value: Any) -> list[Any]:
    """The Lazy values in a point's value (itself, or in its list or dict)."""
    from minisgl.ext.lazy import Lazy

    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, (list, type({}.values()))):
        return [v for v in items if isinstance(v, Lazy)]
    return [value] if isinstance(value, Lazy) else []


@pytest.mark.ext
def test_every_lazy_point_names_something_callable() -> None:
    exts = extension.extensions()
    found = [lazy for f in exts.__dataclass_fields__ for lazy in lazy_values(getattr(exts, f))]
    assert len(found) >= 8  # perf's, sampling's, spec's and cpu's engine parts at least
    for lazy in found:
        assert callable(lazy.resolve()), lazy
