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
from minisgl.models.hf import load_tokenizer

exts = extensions()
params = {"temperature": 0.5, **({"logprobs": 2, "min_tokens": 2} if exts.loaded else {})}
SamplingParams(**params)
parse_args(["--model", sys.argv[1]])
tok = load_tokenizer(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
detok = request_detokenizer(tok, [], True, ["zz"], params.get("min_tokens", 0))
print("loaded" if exts.loaded else "core", "torch" in sys.modules)
"""


# A tokenizer worker's and the detokenizer's own work, as their processes do it: the modules a
# spawned child imports (the launcher's `_child_main`, its target, the worker the launcher hands
# it), then a chat tokenized and its tokens detokenized (stop strings, min_tokens,
# log-probabilities' texts) through the worker classes, the queues faked. Neither process may
# import the API process's fastapi or prometheus_client, nor numpy before transformers does
# (ext/cpu's GGUF reader needs it; issue 47: ~0.4 s of CPU each at every start).
WORKERS_SCRIPT = """
import sys
import minisgl.server.launch, minisgl.tokenizer.server, minisgl.tokenizer.detokenize
from minisgl.extension import extensions
from minisgl.tokenizer.server import TokenizerWorker
from minisgl.tokenizer.detokenize import Detokenizer

exts = extensions()
if exts.loaded:  # the serving launcher's worker, unpickled in the tokenizer process
    from minisgl.ext.serving.worker import ServingTokenizerWorker as TokenizerWorker
HEAVY = ("fastapi", "numpy", "prometheus_client", "transformers")
print(sorted(m for m in HEAVY if m in sys.modules))

from minisgl.core import SamplingParams
from minisgl.message import DetokenizeMsg, TokenizeMsg
from minisgl.models.hf import load_tokenizer, transformers_without_torch

class Sent(list):
    put = list.append

transformers_without_torch()
sched, detok_q, api = Sent(), Sent(), Sent()
worker = TokenizerWorker(load_tokenizer(sys.argv[1]), [sched], detok_q, api)
extra = {"min_tokens": 1, "logprobs": 1} if exts.loaded else {}
chat = [{"role": "user", "content": "hello"}]
worker.handle(TokenizeMsg(1, None, None, chat, SamplingParams(stop=["zz"], **extra)))
assert sched and detok_q and not api, api
detok = Detokenizer(load_tokenizer(sys.argv[1]), Sent(), [Sent()])
assert not detok.init(detok_q[0])
logprob = {"logprob": [-0.5, [5], [-0.5]]} if exts.loaded else {}
reply = detok.guarded(DetokenizeMsg(1, [5], True, "length", ext=logprob))
assert reply is not None and reply.error is None, reply
assert ("logprobs" in reply.ext) == exts.loaded, reply
print(sorted(m for m in ("fastapi", "prometheus_client") if m in sys.modules))
"""


def run_light(model: str, core_alone: bool, script: str = SCRIPT) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    env.pop("MINISGL_DISABLE_EXTENSIONS", None)
    if core_alone:
        env["MINISGL_DISABLE_EXTENSIONS"] = "1"
    cmd = [sys.executable, "-c", script, model]
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


@pytest.mark.parametrize("core_alone", [True, pytest.param(False, marks=pytest.mark.ext)])
def test_tokenizer_and_detokenizer_import_no_api_modules(
    tokenizer_dir: str, core_alone: bool
) -> None:
    assert run_light(tokenizer_dir, core_alone, WORKERS_SCRIPT).splitlines() == ["[]", "[]"]


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
