"""OpenAI parity of the HTTP surface, on a real server (tiny model): --served-model-name,
--chat-template, max_completion_tokens, the developer role, chat_template_kwargs, /tokenize and
/detokenize, and the honest refusals (fields, content parts and lengths minisgl cannot serve)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from support.server import Server, make_tiny_model, run_server, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
SERVED = "my-model"
CONTEXT = 64
# the server's --chat-template (a file): the tiny template plus a keyword argument `shout`
TEMPLATE = (
    "{{ bos_token }}{% if shout %}LOUD {% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CHAT = [{"role": "user", "content": "hello world"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("logs")
    template = logs / "template.jinja"
    template.write_text(TEMPLATE)
    args = ("--page-size", "4", "--max-model-len", str(CONTEXT), "--served-model-name", SERVED)
    with run_server(
        model_dir, *args, "--chat-template", str(template), log_path=str(logs / "s.log")
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def prompt_len(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> int:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


def assert_refused(r: httpx.Response, param: str | None, *mentions: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in mentions:
        assert word in error["message"], error


# ---- served model name and chat template -------------------------------------------------
def test_served_model_name(client: OpenAI, model_dir: str) -> None:
    assert [m.id for m in client.models.list().data] == [SERVED]
    for name in (SERVED, model_dir, "tiny"):  # the path and its directory name still work
        out = client.completions.create(model=name, prompt="hi", max_tokens=1)
        assert out.model == SERVED
    with pytest.raises(openai.NotFoundError, match=SERVED):
        client.completions.create(model="other", prompt="hi", max_tokens=1)


def test_chat_template_override_and_kwargs(client: OpenAI, tokenizer: Any) -> None:
    for kwargs in ({}, {"shout": True}):
        out = client.chat.completions.create(
            model=SERVED,
            messages=CHAT,
            max_tokens=1,
            extra_body={"chat_template_kwargs": kwargs},
        )
        assert out.usage.prompt_tokens == prompt_len(tokenizer, CHAT, **kwargs)
    plain = prompt_len(tokenizer, CHAT)
    assert prompt_len(tokenizer, CHAT, shout=True) > plain  # the kwarg did reach the template


def test_developer_role_is_system(client: OpenAI, tokenizer: Any) -> None:
    developer = [{"role": "developer", "content": "be brief"}, *CHAT]
    out = client.chat.completions.create(model=SERVED, messages=developer, max_tokens=1)
    system = [{"role": "system", "content": "be brief"}, *CHAT]
    assert out.usage.prompt_tokens == prompt_len(tokenizer, system)


def test_max_completion_tokens(client: OpenAI, server: Server) -> None:
    out = client.chat.completions.create(
        model=SERVED, messages=CHAT, max_completion_tokens=3, extra_body=NO_EOS
    )
    assert out.usage.completion_tokens == 3
    out = client.chat.completions.create(
        model=SERVED, messages=CHAT, max_completion_tokens=2, max_tokens=2, extra_body=NO_EOS
    )
    assert out.usage.completion_tokens == 2
    body = {"messages": CHAT, "max_completion_tokens": 2, "max_tokens": 3}
    assert_refused(post(server, "/v1/chat/completions", body), "max_completion_tokens", "2", "3")


# ---- /tokenize and /detokenize ---------------------------------------------------------------
def test_tokenize_and_detokenize(server: Server, tokenizer: Any) -> None:
    r = post(server, "/tokenize", {"model": SERVED, "prompt": "hello world"})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("hello world")
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": CONTEXT}
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}

    chat = {"messages": CHAT, "chat_template_kwargs": {"shout": True}}
    for with_prompt in (True, False):
        r = post(server, "/tokenize", {**chat, "add_generation_prompt": with_prompt})
        text = tokenizer.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=with_prompt, shout=True
        )
        assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"x": 2**70}}, None),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}}, None),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_tokenize_refusals(
    server: Server, path: str, body: dict[str, Any], param: str | None
) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    r = post(server, path, {**body, "model": "other"})
    assert r.status_code in (400, 404)


# ---- refusals ----------------------------------------------------------------------------
CHAT_FIELDS = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
}
COMPLETION_FIELDS = {"suffix": "end", "best_of": 2}


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_unsupported_chat_fields(server: Server, field: str) -> None:
    body = {"messages": CHAT, "max_tokens": 1, field: CHAT_FIELDS[field]}
    assert_refused(post(server, "/v1/chat/completions", body), field, field, "not supported")


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_unsupported_completion_fields(server: Server, field: str) -> None:
    body = {"prompt": "hi", "max_tokens": 1, field: COMPLETION_FIELDS[field]}
    assert_refused(post(server, "/v1/completions", body), field, field, "not supported")


def test_off_values_and_unknown_fields_are_accepted(server: Server) -> None:
    off = {"logprobs": False, "tools": [], "user": "u", "store": False}
    body = {"messages": CHAT, "max_tokens": 1, **off}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    body = {"prompt": "hi", "max_tokens": 1, "echo": False, "best_of": 1, "logprobs": None}
    assert post(server, "/v1/completions", body).status_code == 200
    # a field that is not OpenAI's is ignored, with one warning naming it
    body = {"prompt": "hi", "max_tokens": 1, "frobnicate_level": 3}
    assert post(server, "/v1/completions", body).status_code == 200
    line = "/v1/completions: ignoring unknown fields 'frobnicate_level'"
    wait_for(lambda: line in server.log(), 10, "the warning")
    assert server.log().count(line) == 1
    assert "'user'" not in server.log()  # OpenAI's fields of no effect: no warning


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
    ],
)
def test_non_text_content_parts(server: Server, part: dict[str, Any]) -> None:
    content = [{"type": "text", "text": "what is this?"}, part]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    assert_refused(post(server, "/v1/chat/completions", body), "messages", part["type"])


def test_tool_calls_in_history(server: Server) -> None:
    """An agent loop's history reaches the template (this server has no tool call parser)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    result = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}, result]
    body = {"messages": history, "max_tokens": 1}
    assert post(server, "/v1/chat/completions", body).status_code == 200


def test_tools_without_a_parser(server: Server) -> None:
    """Tools are shown to the model with tool_choice none; parsing calls needs the flag."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": CHAT, "max_tokens": 1, "tools": tools}
    r = post(server, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert r.status_code == 200
    refused = post(server, "/v1/chat/completions", body)  # auto found no format in the template
    assert_refused(refused, "tools", "--tool-call-parser", "no tool call format was recognised")
    legacy = {"messages": CHAT, "max_tokens": 1, "functions": [{"name": "f"}]}
    assert_refused(post(server, "/v1/chat/completions", legacy), "functions", "tool call parser")


def test_unknown_role(server: Server) -> None:
    body = {"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 1}
    assert_refused(post(server, "/v1/chat/completions", body), "messages", "robot", "role")


def test_n_cap(server: Server) -> None:
    body = {"prompt": "hi", "max_tokens": 1, "n": 65}
    assert_refused(post(server, "/v1/completions", body), "n", "64")


def test_max_tokens_beyond_the_context(server: Server, tokenizer: Any) -> None:
    numbers = ["prompt (10 tokens) + max_tokens (60) = 70 tokens", f"at most {CONTEXT} tokens"]
    body = {"prompt": list(range(3, 13)), "max_tokens": 60}
    assert_refused(post(server, "/v1/completions", body), None, *numbers)
    n = prompt_len(tokenizer, CHAT)
    body = {"messages": CHAT, "max_completion_tokens": CONTEXT - n + 1, "stream": True}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and f"prompt ({n} tokens)" in r.text, r.text
    # a prompt too long by itself gets the scheduler's refusal
    body = {"prompt": list(range(3, 3 + CONTEXT)), "max_tokens": 1}
    assert_refused(post(server, "/v1/completions", body), None, "longer than the context")
    # exactly the context fits; unset, max_tokens runs up to the context
    body = {"prompt": list(range(3, 13)), "max_tokens": CONTEXT - 10, "ignore_eos": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CONTEXT - 10
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == CONTEXT - n


# ---- without a server --------------------------------------------------------------------
def test_chat_template_flag_takes_a_file_or_the_text(model_dir: str, tmp_path: Any) -> None:
    from minisgl.ext.serving.options import serving_options
    from minisgl.ext.serving.template import load_chat_tokenizer
    from minisgl.server.args import parse_args

    args = parse_args(["--served-model-name", "x", "--chat-template", "{{ 1 }}"])
    assert (args.served_model_name, serving_options(args).chat_template) == ("x", "{{ 1 }}")
    assert load_chat_tokenizer(model_dir, "{{ 'inline' }}").chat_template == "{{ 'inline' }}"
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_tokenizer(model_dir, str(path)).chat_template == TEMPLATE
    original = AutoTokenizer.from_pretrained(model_dir).chat_template
    assert load_chat_tokenizer(model_dir, None).chat_template == original


# ---- batched completion prompts ----------------------------------------------------------
def test_batched_completion_prompts(server: Server) -> None:
    """A list of prompts (strings or token-id lists): one choice per prompt x n, indexed
    k * n + j as OpenAI does, each equal to the prompt's own completion; usage counts every
    prompt once."""
    base = {"model": SERVED, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for prompts in (["hello there", "the quick brown fox", "a"], [[5, 6, 7], [9, 10]]):
        out = post(server, "/v1/completions", {**base, "prompt": prompts, "n": 2}).json()
        assert [c["index"] for c in out["choices"]] == list(range(2 * len(prompts)))
        singles = [post(server, "/v1/completions", {**base, "prompt": p}).json() for p in prompts]
        for k, single in enumerate(singles):
            want = single["choices"][0]["text"]
            assert [c["text"] for c in out["choices"][2 * k : 2 * k + 2]] == [want, want]
        assert out["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
        assert out["usage"]["completion_tokens"] == 2 * len(prompts) * 4
    # streamed: every choice's index appears, and usage counts each prompt once
    body = {**base, "prompt": [[5, 6, 7], [9, 10]], "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
    assert events[-1]["usage"]["prompt_tokens"] == 5
    too_many = {**base, "prompt": ["a"] * 513, "n": 2}
    assert_refused(post(server, "/v1/completions", too_many), "prompt", "513")
