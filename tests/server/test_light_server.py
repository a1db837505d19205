"""A running server's tokenizer worker, detokenizer and API process never load torch (issue 47),
also once they served requests that use the extensions' request-time paths (log-probabilities,
min_tokens' stop strings, a JSON schema, tools, /tokenize); the scheduler does (the check sees
libtorch where it is)."""

from __future__ import annotations

import os
from collections.abc import Callable

import httpx
import pytest

from support.server import TINY_SERVER, Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc/PID/maps")
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server(*TINY_SERVER)


def maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_light_processes_never_load_torch(server: Server) -> None:
    chat = [{"role": "user", "content": "hi"}]
    bodies = {
        "/v1/chat/completions": [
            {"messages": chat, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
            {"messages": chat, "max_tokens": 4, "tools": [TOOL], "tool_choice": "none"},
            {"messages": chat, "max_tokens": 4, "response_format": {"type": "json_object"}},
        ],
        "/v1/completions": [
            {"prompt": "a b", "max_tokens": 4, "min_tokens": 2, "stop": ["zz"], "logprobs": 1},
        ],
        "/tokenize": [{"messages": chat, "tools": [TOOL]}],
    }
    for path, requests in bodies.items():
        for body in requests:
            r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)
            assert r.status_code == 200, (path, body, r.text)
    light = {name: server.child_pid(name) for name in ("tokenizer_0", "detokenizer")}
    light["api"] = server.proc.pid
    assert {name: maps_torch(pid) for name, pid in light.items()} == dict.fromkeys(light, False)
    assert maps_torch(server.child_pid("scheduler_0"))  # the check finds it where it is
