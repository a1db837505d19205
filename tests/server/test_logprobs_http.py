"""Log-probabilities over HTTP against transformers (float32, tiny model): completions' legacy
object with echo (scoring with max_tokens 0, batched token-id prompts), chat's logprobs.content,
both streamed and not, through the official openai client; and the refusals."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from support.server import Server, make_tiny_model, run_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
TOL = 1e-4
PROMPTS = [[5, 17, 93, 4, 61, 28, 7], [40, 41, 42, 300, 2, 9]]
CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="module")
def hf(model_dir: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("logs") / "s.log")
    # a small prefill budget: prompts are scored over several chunks
    with run_server(
        model_dir,
        "--page-size",
        "4",
        "--max-prefill-tokens",
        "4",
        "--served-model-name",
        "x",
        log_path=log,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@torch.no_grad()
def hf_rows(hf: Any, tokens: list[int]) -> torch.Tensor:
    """Row p: the log-distribution of the token after tokens[: p + 1]."""
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def texts(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def check_legacy(lp: dict[str, Any], ids: list[int], rows: torch.Tensor, tok: Any, k: int) -> None:
    """The legacy object of `ids` (row p of `rows` predicts ids[p + 1]; ids[0] is unpredicted)."""
    assert lp["tokens"] == texts(tok, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    for p in range(1, len(ids)):
        row = rows[p - 1]
        assert math.isclose(lp["token_logprobs"][p], float(row[ids[p]]), abs_tol=TOL)
        top = row.topk(k)
        expected = {tok.decode([int(i)]): float(v) for i, v in zip(top.indices, top.values)}
        expected[tok.decode([ids[p]])] = float(row[ids[p]])
        got = lp["top_logprobs"][p]
        assert got.keys() == expected.keys()
        assert all(math.isclose(got[t], expected[t], abs_tol=TOL) for t in got)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_prompts(client: OpenAI, hf: Any, tokenizer: Any, max_tokens: int):
    """lm-eval's loglikelihood request: batched token-id prompts, echo, logprobs."""
    out = client.completions.create(
        model="x", prompt=PROMPTS, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, out.choices):
        lp = choice.logprobs.model_dump()
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        generated = [int(hf_rows(hf, prompt)[-1].argmax())][:max_tokens]
        ids = prompt + generated
        check_legacy(lp, ids, hf_rows(hf, ids), tokenizer, 2)
        assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(generated)
        assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == max_tokens * len(PROMPTS)


def test_streamed_completion_equals_whole(client: OpenAI) -> None:
    args = dict(model="x", prompt=PROMPTS[0], echo=True, logprobs=3, max_tokens=5, temperature=0)
    whole = client.completions.create(**args).choices[0]
    tokens: list[str] = []
    logprobs: list[float | None] = []
    offsets: list[int] = []
    text = ""
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert logprobs == whole.logprobs.token_logprobs


def test_completion_logprobs_without_echo(client: OpenAI, hf: Any, tokenizer: Any) -> None:
    out = client.completions.create(
        model="x",
        prompt=PROMPTS[1],
        logprobs=0,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and lp.text_offset[0] == 0
    ids, rows = list(PROMPTS[1]), None
    for _ in range(4):
        rows = hf_rows(hf, ids)
        ids.append(int(rows[-1].argmax()))
    assert rows is not None
    rows = hf_rows(hf, ids)
    for i, t in enumerate(ids[len(PROMPTS[1]) :]):
        assert lp.tokens[i] == tokenizer.decode([t])
        assert math.isclose(
            lp.token_logprobs[i], float(rows[len(PROMPTS[1]) + i - 1][t]), abs_tol=TOL
        )
        assert lp.top_logprobs[i] == {lp.tokens[i]: lp.token_logprobs[i]}  # logprobs 0: itself


def chat_ids(tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_logprobs_equal_transformers(client: OpenAI, hf: Any, tokenizer: Any) -> None:
    args = dict(
        model="x", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    out = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    prompt = chat_ids(tokenizer)
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(hf_rows(hf, ids)[-1].argmax()))
    rows = hf_rows(hf, ids)[len(prompt) - 1 :]
    assert len(content) == 5
    for entry, token, row in zip(content, ids[len(prompt) :], rows):
        assert entry.token == tokenizer.decode([token])
        assert entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=TOL)
        top = row.topk(3)
        assert [t.token for t in entry.top_logprobs] == texts(tokenizer, top.indices.tolist())
        for t, v in zip(entry.top_logprobs, top.values.tolist()):
            assert math.isclose(t.logprob, v, abs_tol=TOL)
    streamed = []
    for chunk in client.chat.completions.create(
        **args, extra_body={"ignore_eos": True}, stream=True
    ):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_no_logprobs_unless_asked(client: OpenAI) -> None:
    out = client.chat.completions.create(model="x", messages=CHAT, max_tokens=2)
    assert out.choices[0].logprobs is None
    out = client.completions.create(model="x", prompt=PROMPTS[0], max_tokens=2, echo=True)
    assert out.choices[0].logprobs is None


def test_echo_without_logprobs_and_max_tokens_zero(client: OpenAI, tokenizer: Any) -> None:
    out = client.completions.create(model="x", prompt="hello world", echo=True, max_tokens=0)
    assert out.choices[0].text == "hello world" and out.usage.completion_tokens == 0


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_refusals(server: Server, path: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json={"max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_no_pages_left(server: Server) -> None:
    stats = server.wait_idle()
    assert stats["leaked_pages"] == 0 and stats["running"] == 0
