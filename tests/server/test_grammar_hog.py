"""Issue 52 acceptance: a grammar that would keep xgrammar busy for minutes (a JSON schema of
1,100 nested arrays, 27.5 KB) does not freeze the server. While it compiles, plain requests on
the tiny model finish in well under 5 s each (they took 31-35 s when the scheduler waited for
the compile) and a small constrained request is served by another compiler process; the hog
ends with an error once past --grammar-compile-timeout (its process killed); the server then
answers at once, no KV page is left owned, and no compiler process survives the server."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import Server, cmdline, descendants, make_tiny_model, run_server, wait_for

TIMEOUT_S = 3  # --grammar-compile-timeout here
PLAIN_BOUND_S = 5.0  # the acceptance bound for a plain request during the compile


def nested_arrays(depth: int) -> str:
    """As JSON text (json.dumps would recurse too deep): 27.5 KB for depth 1,100."""
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))
    log = str(tmp_path_factory.mktemp("logs") / "hog.log")
    args = ["--page-size", "4", "--grammar-compile-timeout", str(TIMEOUT_S)]
    with run_server(model, *args, log_path=log) as s:
        yield s


def complete(server: Server, **extra: Any) -> httpx.Response:
    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def compilers(server: Server) -> list[tuple[int, int]]:
    """The server's grammar compiler processes (ext/structured/grammar.py run by its path)."""
    return [p for p in descendants(server.proc.pid) if "grammar.py" in cmdline(p[0])]


def test_plain_requests_go_on_while_a_grammar_compiles_for_minutes(server: Server) -> None:
    hog = nested_arrays(1100)
    assert len(hog) < 65536  # under the server's limit on grammar text
    replies: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: replies.append(complete(server, json_schema=hog)))
    thread.start()
    wait_for(lambda: server.stats()["waiting"] >= 1, 30, "the hog to reach the scheduler")
    wait_for(lambda: compilers(server) or None, 30, "a compiler process")
    server.children = descendants(server.proc.pid)  # they too must not outlive the server
    latencies = []
    while thread.is_alive() or len(latencies) < 3:
        start = time.monotonic()
        r = complete(server)
        latencies.append(time.monotonic() - start)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        if len(latencies) == 2:  # another grammar compiles meanwhile, in another process
            small = complete(server, regex="[ab]{3}")
            assert small.status_code == 200, small.text
            assert re.fullmatch("[ab]{3}", small.json()["choices"][0]["text"])
    thread.join()
    assert max(latencies) < PLAIN_BOUND_S, latencies
    (reply,) = replies
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert message == f"grammar compilation took longer than {TIMEOUT_S} s", message
    again = complete(server)  # right after: the server answers
    assert again.status_code == 200, again.text
    repeat = complete(server, json_schema=hog)  # the failure is cached: no second compile
    assert repeat.status_code == 400 and repeat.json()["error"]["message"] == message
    stats = server.wait_idle()
    assert stats["leaked_pages"] == 0 and stats["locked_pages"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]
