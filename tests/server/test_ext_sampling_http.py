"""The server without the sampling and structured extensions (issue 46): a tiny-model server
started with MINISGL_DISABLE_EXTENSIONS=1 refuses with a 400 naming the field every request
that sets a parameter one of them implements (penalties, logit_bias, min_tokens, logprobs,
echo's prompt logprobs, the output constraints and response_format; the serving extension's
priority), saying which extension it needs, and serves the same request without it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import Server, tiny_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
ALONE = {"MINISGL_DISABLE_EXTENSIONS": "1"}
CHAT = [{"role": "user", "content": "hello world"}]
SCHEMA = {"type": "object"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tmp_path_factory, "--page-size", "4", extra_env=ALONE) as s:
        yield s


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
        ("/v1/completions", {"echo": True, "max_tokens": 0, "logprobs": 1}, "logprobs", "sampling"),
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
