"""The server without the sampling and structured extensions (issue 46): a tiny-model server
started with MINISGL_DISABLE_EXTENSIONS=1 refuses with a 400 naming the field every request
that sets a parameter one of them implements (penalties, logit_bias, min_tokens, logprobs,
echo's prompt logprobs, the output constraints and response_format; the serving extension's
priority), saying which extension it needs, and serves the same request without it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from support.server import Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
ALONE = {"MINISGL_DISABLE_EXTENSIONS": "1"}
CHAT = [{"role": "user", "content": "hello world"}]
SCHEMA = {"type": "object"}


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server("--page-size", "4", extra_env=ALONE)  # test_ext_structured_http's too


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.parametrize(
    ("path", "extra", "param", "ext"),
    [
        ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty", "sampling"),
        ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty", "sampling"),
        ("/v1/chat/completions", {"repetition_penalty": 1.1}, "repetition_penalty", "sampling"),
        ("/v1/chat/completions", {"logit_bias": {"5": 3}}, "logit_bias", "sampling"),
        ("/v1/chat/completions", {"min_tokens": 2}, "min_tokens", "sampling"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs", "sampling"),
        ("/v1/completions", {"logprobs": 2}, "logprobs", "sampling"),
        ("/v1/completions", {"logprobs": 1, "echo": True, "max_tokens": 0}, "logprobs", "sampling"),
        ("/v1/completions", {"echo": True}, "echo", "sampling"),
        ("/v1/completions", {"echo": True, "max_tokens": 0}, "echo", "sampling"),
        ("/v1/chat/completions", {"regex": "[ab]+"}, "regex", "structured"),
        ("/v1/completions", {"json_schema": SCHEMA}, "json_schema", "structured"),
        ("/v1/chat/completions", {"ebnf": 'root ::= "a"'}, "ebnf", "structured"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}},
            "response_format",
            "structured",
        ),
        ("/v1/chat/completions", {"priority": -2}, "priority", "serving"),
        ("/v1/completions", {"priority": 3}, "priority", "serving"),
    ],
)
def test_extension_parameters_are_refused(
    server: Server, path: str, extra: dict[str, Any], param: str, ext: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 2, **extra}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "hello world"})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    needs = f"{param} needs the {ext} extension (minisgl/ext/{ext})"
    assert error["param"] == param and error["message"] == needs, error
    for name in extra:
        body.pop(name)
    body["max_tokens"] = 2
    assert post(server, path, body).status_code == 200  # the same request without it


def test_generate_refuses_them_too(server: Server) -> None:
    params = {"max_new_tokens": 2, "logit_bias": {"5": 1.0}}
    r = post(server, "/generate", {"text": "hello", "sampling_params": params})
    assert r.status_code == 400, r.text
    assert "logit_bias needs the sampling extension" in r.text
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    assert post(server, "/generate", body).status_code == 200
    r = post(server, "/generate", body | {"priority": 1})  # SGLang's place for it
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "priority needs the serving extension" in r.text


def test_invalid_text_is_a_400_without_the_serving_extension(server: Server) -> None:
    """The serving extension names the field of an unpaired surrogate; the core alone still
    answers a 400 (the text cannot travel to the tokenizer), and the server serves on."""
    raw = '{"prompt": "a \\ud800 b", "max_tokens": 2}'
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers=headers, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_unicode", r.text
    assert post(server, "/v1/completions", {"prompt": "a b", "max_tokens": 2}).status_code == 200
