"""The server without the structured extension (issue 46): a tiny-model server started with
MINISGL_DISABLE_EXTENSIONS=1 serves plain chats (streamed or not) and refuses with a 400 naming
the field every chat request that asks for tool calling (tools, legacy functions, a
tool_choice, earlier tool calls in the history; /tokenize's tools, with the serving extension's
/tokenize), saying that it needs the structured extension; --tool-call-parser and
--reasoning-parser are refused at start, for the server and the shell."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from support.server import REPO, Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
NEEDS = "needs the structured extension (minisgl/ext/structured)"
ALONE = {"MINISGL_DISABLE_EXTENSIONS": "1"}
CHAT = [{"role": "user", "content": "hello world"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
HISTORY = [
    *CHAT,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
]


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server("--page-size", "4", extra_env=ALONE)  # test_ext_sampling_http's too


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_plain_chat_is_served(server: Server, stream: bool) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "ignore_eos": True, "stream": stream}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    if not stream:
        (choice,) = r.json()["choices"]
        assert isinstance(choice["message"]["content"], str)
        assert "reasoning_content" not in choice["message"]
        assert choice["finish_reason"] == "length"
    else:
        assert r.text.endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in r.text


@pytest.mark.parametrize(
    ("extra", "param", "what"),
    [
        ({"tools": TOOLS}, "tools", "tools"),
        ({"tools": TOOLS, "stream": True}, "tools", "tools"),
        ({"tools": TOOLS, "tool_choice": "none"}, "tools", "tools"),
        ({"functions": [TOOLS[0]["function"]]}, "functions", "functions"),
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice"),
        ({"function_call": "none"}, "function_call", "function_call"),
        ({"messages": HISTORY}, "messages", "messages[1].tool_calls"),
    ],
)
def test_tool_calling_is_refused(
    server: Server, extra: dict[str, Any], param: str, what: str
) -> None:
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] == f"{what} {NEEDS}", error


@pytest.mark.ext
def test_tokenize_tools_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving extension's /tokenize (a plain chat is served: test_openai_surface) without
    the structured extension: its route, called with a registry that lacks chat_features."""
    from minisgl.ext.serving.tokenize import TokenizeRequest, tokenize
    from minisgl.extension import extensions
    from minisgl.server.protocol import APIError

    monkeypatch.setattr(extensions(), "chat_features", None)
    api: Any = SimpleNamespace(check_model=lambda name: None, max_seq_len=64)
    req = TokenizeRequest.model_validate({"messages": CHAT, "tools": TOOLS})
    with pytest.raises(APIError) as refused:
        asyncio.run(tokenize(api, req))
    error = refused.value
    assert (error.status, error.param, error.message) == (400, "tools", f"tools {NEEDS}")


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--tool-call-parser", "hermes"], "--tool-call-parser"),
        (["--reasoning-parser", "qwen3"], "--reasoning-parser"),
        (["--shell", "--reasoning-parser", "qwen3"], "--reasoning-parser"),
        (["--shell", "--shell-hide-reasoning"], "--shell-hide-reasoning"),
    ],
)
def test_parser_flags_are_refused_at_start(flags: list[str], flag: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), **ALONE)
    cmd = [sys.executable, "-m", "minisgl", *flags]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"error: {flag} {NEEDS}" in done.stderr, done.stderr
