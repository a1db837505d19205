"""Penalties, logit_bias and min_tokens over HTTP: the same tokens as the offline LLM, min_tokens
holding back stop strings, and a 400 naming the field for a bad value."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from minisgl import LLM, SamplingParams
from minisgl.models.hf import load_tokenizer
from minisgl.tokenizer.detokenize import request_detokenizer
from support.server import TINY_SERVER, Server, make_tiny_model

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"))


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server(*TINY_SERVER)


def complete(server: Server, **fields: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_fields_reach_the_engine(server: Server, model_dir: str) -> None:
    fields: dict[str, Any] = dict(
        frequency_penalty=1.2, presence_penalty=0.5, repetition_penalty=1.4, min_tokens=3
    )
    llm = LLM(model_dir, page_size=4)
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True, **fields)
        want = llm.generate([PROMPT], params, use_tqdm=False)[0]["text"]
        plain = llm.generate([PROMPT], SamplingParams(max_tokens=8), use_tqdm=False)[0]["text"]
    finally:
        llm.shutdown()
    r = complete(server, **fields)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want != plain
    forced = complete(server, logit_bias={"7": 100}, max_tokens=3)  # JSON keys are strings
    assert forced.status_code == 200, forced.text
    native = httpx.post(
        f"{server.url}/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 3, "logit_bias": {"7": 100}},
        },
        timeout=60,
    )
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == [7, 7, 7]


BAD = [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"one": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
    ({"priority": 2**40}, "priority"),
    ({"priority": "high"}, "priority"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_values_are_400_naming_the_field(server: Server, fields: dict, param: str) -> None:
    r = complete(server, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logit_bias_outside_the_vocabulary_is_refused(server: Server) -> None:
    r = complete(server, logit_bias={str(10**6): 1})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


def test_min_tokens_holds_back_stop_strings(server: Server, model_dir: str) -> None:
    """A stop string in the greedy output's first tokens ends it, unless min_tokens says go on:
    then the text is what the detokenizer makes of those tokens with min_tokens (vLLM's rule)."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    full = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    tokenizer = load_tokenizer(model_dir)
    first = tokenizer.decode(full["output_ids"][:1], skip_special_tokens=True)
    stop = next(c for c in first if not c.isspace() and c != "\ufffd")  # in the first token
    cut = complete(server, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    for min_tokens in (3, 8):
        detok = request_detokenizer(tokenizer, PROMPT, True, [stop], min_tokens)
        want = "".join(detok.add([t]) for t in full["output_ids"]) + detok.finish()
        r = complete(server, stop=[stop], min_tokens=min_tokens)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        assert len(want) > full["text"].index(stop)  # went on past the early stop string
    assert want == full["text"]  # min_tokens = max_tokens: no stop string can end it


def test_priority_is_accepted_where_vllm_and_sglang_put_it(server: Server) -> None:
    """A top-level field on the OpenAI endpoints and /generate (and in its sampling_params);
    under the default fcfs policy it changes no output."""
    plain = complete(server).json()["choices"][0]["text"]
    assert complete(server, priority=-3).json()["choices"][0]["text"] == plain
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
    for extra in ({"priority": 7}, {"sampling_params": {"max_new_tokens": 3, "priority": 7}}):
        r = httpx.post(f"{server.url}/generate", json=body | extra, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/generate", json=body | {"priority": 1.5}, timeout=60)
    assert r.status_code == 400
