"""What eval and bench clients read besides the completion itself, on one tiny-model server
(--page-size 4): `usage.prompt_tokens_details.cached_tokens` (chat, completions, streamed; and
through /v1/responses and /v1/messages), vLLM's `stream_options.continuous_usage_stats`, SGLang's
`meta_info` on /generate (plain and streamed), vLLM's /tokenizer_info and /tokenize's
add_special_tokens."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from support.server import Server, make_tiny_model, run_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
PAGE = 4
MODEL = "x"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("logs") / "s.log")
    args = ("--page-size", str(PAGE), "--served-model-name", MODEL)
    with run_server(model_dir, *args, log_path=log) as s:
        yield s


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data events of a streamed response, [DONE] left out."""
    events = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def prompt(seed: int, length: int = 21) -> list[int]:
    """Token ids no other test sends (the prefix cache is shared by the whole module)."""
    return [(seed * 131 + i * 7) % 500 + 3 for i in range(length)]


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_cached_tokens(server: Server) -> None:
    ids = prompt(1)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0}
    first, again = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    assert cached(first) == 0
    hit = cached(again)
    assert PAGE <= hit < len(ids) and hit % PAGE == 0
    assert again["usage"]["prompt_tokens"] == len(ids)
    # several prompts: summed; n samples of one prompt: counted once, as its prompt_tokens
    two = post(server, "/v1/completions", body | {"prompt": [ids, ids]})
    assert cached(two) == 2 * hit and two["usage"]["prompt_tokens"] == 2 * len(ids)
    n2 = post(server, "/v1/completions", body | {"n": 2, "temperature": 1.0, "seed": 3})
    assert cached(n2) == hit and n2["usage"]["prompt_tokens"] == len(ids)
    # streamed: in the usage chunk
    events = stream(
        server,
        "/v1/completions",
        body | {"stream": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1]["choices"] == [] and cached(events[-1]) == hit


def test_chat_cached_tokens(server: Server) -> None:
    chat = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, twice"}]
    body = {"model": MODEL, "messages": chat, "max_tokens": 2, "temperature": 0}
    first = post(server, "/v1/chat/completions", body)
    assert cached(first) == 0
    again = post(server, "/v1/chat/completions", body)
    assert cached(again) >= PAGE
    options = {"include_usage": True}
    events = stream(
        server, "/v1/chat/completions", body | {"stream": True, "stream_options": options}
    )
    assert cached(events[-1]) == cached(again)


def test_responses_and_messages_report_cached_tokens(server: Server) -> None:
    """Read from the chat path's usage (the chat template's opening may be cached already)."""
    body = {"model": MODEL, "input": "a small fast server answers", "max_output_tokens": 2}
    first = post(server, "/v1/responses", body | {"temperature": 0})["usage"]
    again = post(server, "/v1/responses", body | {"temperature": 0})["usage"]
    hit = again["input_tokens_details"]["cached_tokens"]
    assert hit >= PAGE and hit > first["input_tokens_details"]["cached_tokens"]
    assert hit < again["input_tokens"] == first["input_tokens"]
    ask = [{"role": "user", "content": "hello world, the radix cache hits"}]
    body = {"model": MODEL, "messages": ask, "max_tokens": 2, "temperature": 0}
    first = post(server, "/v1/messages", body)["usage"]
    again = post(server, "/v1/messages", body)["usage"]
    hit = again["cache_read_input_tokens"]
    assert hit >= PAGE and hit > first.get("cache_read_input_tokens", 0)
    # Anthropic's input_tokens leaves out the ones read from the cache
    prompt = first["input_tokens"] + first.get("cache_read_input_tokens", 0)
    assert again["input_tokens"] == prompt - hit


def test_continuous_usage_stats(server: Server) -> None:
    ids = prompt(2)
    options = {"include_usage": True, "continuous_usage_stats": True}
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for path, source in [
        ("/v1/completions", {"prompt": ids}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world"}]}),
    ]:
        events = stream(server, path, base | source | {"stream": True, "stream_options": options})
        *chunks, last = events
        assert all("usage" in e for e in events)
        prompt_tokens = last["usage"]["prompt_tokens"]
        done = [e["usage"]["completion_tokens"] for e in chunks]
        assert all(e["usage"]["prompt_tokens"] == prompt_tokens for e in chunks)
        assert done == sorted(done) and done[-1] == 6 == last["usage"]["completion_tokens"]
        assert all(
            e["usage"]["total_tokens"] == prompt_tokens + e["usage"]["completion_tokens"]
            for e in chunks
        )
    # without include_usage it would be ignored (vLLM's): refused instead
    r = httpx.post(
        f"{server.url}/v1/completions",
        json=base
        | {"prompt": ids, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    # off: only the last chunk has usage
    events = stream(
        server,
        "/v1/completions",
        base | {"prompt": ids, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]


def test_generate_meta_info(server: Server, model_dir: str) -> None:
    ids = prompt(3)
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}}
    out = post(server, "/generate", body)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 3)
    assert meta["cached_tokens"] == 0 and isinstance(meta["id"], str)
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0
    # the flat fields stay
    assert (out["finish_reason"], out["prompt_tokens"], out["completion_tokens"]) == (
        "length",
        len(ids),
        3,
    )
    again = post(server, "/generate", body)["meta_info"]
    assert again["cached_tokens"] >= PAGE and again["id"] != meta["id"]
    # stopped by a token: the token; by a string: the string
    first = out["output_ids"][0]
    by_token = post(server, "/generate", body | {"sampling_params": {"stop_token_ids": [first]}})
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    text = AutoTokenizer.from_pretrained(model_dir).decode(out["output_ids"])
    stop = text.strip()[:2]
    if stop:  # the tiny model's first tokens decode to text
        params = {"max_new_tokens": 3, "stop": [stop]}
        by_text = post(server, "/generate", body | {"sampling_params": params})
        assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # streamed: every chunk carries it, the last one with the finish and the latency
    events = stream(server, "/generate", body | {"stream": True})
    assert all(e["meta_info"]["id"] == events[0]["meta_info"]["id"] for e in events)
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    last = events[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 3}
    assert last["completion_tokens"] == 3 and last["e2e_latency"] > 0
    assert last["cached_tokens"] == again["cached_tokens"]


def test_tokenizer_info_and_tokenize(server: Server, model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    json.dumps(info)  # plain JSON throughout (special tokens as their text)
    text = "hello world"
    for flag in (True, False):
        got = post(server, "/tokenize", {"prompt": text, "add_special_tokens": flag})
        assert got["tokens"] == tok.encode(text, add_special_tokens=flag)
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos["tokens"] == [tok.eos_token_id]
