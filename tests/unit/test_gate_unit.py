"""The serving extension's gate, its parts driven directly (issue 52): strict decoding of
request bodies, RFC 7235 Authorization (or x-api-key) against --api-key, every response counted
by path and status, the limit on requests in progress that /health is exempt from, the
body-read timeout, a bounded uvicorn that sheds a body that never ends, and the exit log's
filter."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from minisgl.ext.serving.auth import credentials_refused
from minisgl.ext.serving.text import LONE_SURROGATE, NOT_UTF8, invalid_text_path

# (body, what invalid_text_path finds)
BODIES: list[tuple[bytes, tuple[str | None, str] | None]] = [
    (b'{"prompt": "a", "max_tokens": 4}', None),
    ('{"prompt": "caf\u00e9 \U0001f600"}'.encode(), None),  # valid UTF-8
    (b'{"prompt": "\\ud83d\\ude00"}', None),  # an escaped pair
    (b'{"prompt": "\\\\ud800"}', None),  # an escaped backslash, then text
    (b'{"prompt": "\\ud800"}', ("prompt", LONE_SURROGATE)),
    (b'{"x\\ud800": 1}', ("x\\ud800", LONE_SURROGATE)),
    (b'{"prompt": "a\xed\xa0\x80"}', ("prompt", NOT_UTF8)),  # a raw surrogate
    (b'{"prompt": "\xed\xb0\x80\xed\xa0\x80"}', ("prompt", NOT_UTF8)),  # a raw reversed pair
    (b'{"stop": ["x", "\xff"]}', ("stop[1]", NOT_UTF8)),
    (b'{"messages": [{"role": "user", "content": "\xc3"}]}', ("messages[0].content", NOT_UTF8)),
    (b'{"a": {"b\xfe": 1}}', ("a.b\\xfe", NOT_UTF8)),  # a field's name, as sent
    (b'{"max_tokens": 4\xff}', (None, NOT_UTF8)),  # in no string: the body
    (b"\xff\xfe{\x00}\x00", (None, NOT_UTF8)),  # UTF-16: JSON exchanged is UTF-8 (RFC 8259)
    (b"not json \\ud800", None),  # left to FastAPI, which says it is not JSON
]


@pytest.mark.parametrize(("body", "found"), BODIES)
def test_invalid_text_path(body: bytes, found: tuple[str | None, str] | None) -> None:
    assert invalid_text_path(body) == found


KEY = b"sk-1"


@pytest.mark.parametrize(
    ("values", "refused"),
    [
        ([b"Bearer sk-1"], None),
        ([b"bearer sk-1"], None),
        ([b"BEARER sk-1"], None),
        ([b"Bearer   sk-1"], None),  # 1*SP
        ([], "invalid or missing API key"),
        ([b"sk-1"], "invalid or missing API key"),
        ([b"Basic sk-1"], "invalid or missing API key"),
        ([b"Bearer sk-12"], "invalid or missing API key"),
        ([b"Bearersk-1"], "invalid or missing API key"),
        ([b"Bearer sk-1", b"Bearer sk-1"], "2 Authorization headers"),
        ([b"Bearer no", b"Bearer sk-1"], "2 Authorization headers"),  # not the last one's
    ],
)
def test_credentials_refused(values: list[bytes], refused: str | None) -> None:
    headers = [(b"host", b"t"), *((b"authorization", v) for v in values)]
    why = credentials_refused(headers, KEY)
    assert why == refused if refused is None else why is not None and why.startswith(refused)


def test_x_api_key() -> None:
    key = b"k3y"
    assert credentials_refused([(b"x-api-key", key)], key) is None
    assert credentials_refused([(b"authorization", b"Bearer k3y")], key) is None
    assert credentials_refused([(b"x-api-key", b"wrong")], key) is not None
    assert credentials_refused([(b"x-api-key", key), (b"x-api-key", key)], key) is not None
    assert credentials_refused([], key) is not None


class Responses:
    """The responses the gate counted, as (path, status)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def response(self, path: str, status: int) -> None:
        self.seen.append((path, status))


def gated(body_timeout: float = 30.0, max_requests: int = 2048, api_key: str | None = None) -> Any:
    """A FastAPI app under the gate: /slow waits until `app.state.release` (a threading.Event,
    set from any thread) is set, /boom fails; `app.state.responses`: what the gate counted."""
    from fastapi import FastAPI

    app = FastAPI()
    app.state.release = threading.Event()
    app.state.responses = Responses()

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/slow")
    async def slow() -> dict[str, str]:
        while not app.state.release.is_set():
            await asyncio.sleep(0.01)
        return {"ok": "slow"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "health"}

    from minisgl.ext.serving.http import ServingGate
    from minisgl.ext.serving.options import ServingOptions
    from minisgl.server.args import ServerArgs

    frontend: Any = SimpleNamespace(metrics=app.state.responses, api_count=1)
    options = ServingOptions(
        api_key=api_key,
        timeout_body_read=body_timeout,
        max_connections=max_requests,
        max_request_bytes=1000,
    )
    args = ServerArgs(extras={"serving": options})
    paths = frozenset({"/slow", "/health", "/boom"})
    app.add_middleware(ServingGate, args=args, frontend=frontend, paths=paths)
    return app


def test_the_api_key_and_every_response_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key: without it, or a wrong one, 401 asking for Bearer (/health open); Bearer or
    x-api-key pass. Every response is counted by path and status, the gate's own refusals and
    its 500 included, a path not the app's as "other"."""
    monkeypatch.delenv("MINISGL_API_KEY", raising=False)
    app = gated(api_key="sk-1")
    app.state.release.set()

    async def run() -> None:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            for headers in ({}, {"authorization": "Bearer wrong"}):
                r = await client.get("/slow", headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
                assert r.json()["error"]["code"] == "invalid_api_key"
            for headers in ({"authorization": "Bearer sk-1"}, {"x-api-key": "sk-1"}):
                assert (await client.get("/slow", headers=headers)).status_code == 200
            key = {"x-api-key": "sk-1"}
            r = await client.get("/boom", headers=key)
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
            assert (await client.get("/nowhere", headers=key)).status_code == 404
            assert (await client.get("/nowhere")).status_code == 401

    asyncio.run(run())
    assert sorted(app.state.responses.seen) == [
        ("/boom", 500),
        ("/health", 200),
        ("/slow", 200),
        ("/slow", 200),
        ("/slow", 401),
        ("/slow", 401),
        ("other", 401),
        ("other", 404),
    ]


def test_no_key_lets_every_request_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINISGL_API_KEY", raising=False)
    app = gated()

    async def run() -> None:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/nowhere")).status_code == 404

    asyncio.run(run())


def test_requests_beyond_the_limit_get_503_but_health_is_answered() -> None:
    app = gated(max_requests=2)

    async def run() -> None:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            busy = [asyncio.create_task(client.get("/slow")) for _ in range(2)]
            await asyncio.sleep(0.1)
            r = await client.get("/slow")
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "overloaded"
            assert (await client.get("/health")).status_code == 200
            app.state.release.set()
            assert [(await t).status_code for t in busy] == [200, 200]
            assert (await client.get("/slow")).status_code == 200

    asyncio.run(run())


def test_a_body_that_stalls_gets_408_with_connection_close() -> None:
    app = gated(body_timeout=0.2)
    sent: list[dict[str, Any]] = []
    arrived = [{"type": "http.request", "body": b"{", "more_body": True}]

    async def receive() -> dict[str, Any]:
        if arrived:
            return arrived.pop()
        await asyncio.sleep(3600)  # the rest never comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]
    scope = {"type": "http", "method": "GET", "path": "/slow", "headers": headers}
    scope |= {"query_string": b"", "http_version": "1.1", "scheme": "http", "root_path": ""}
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert 0.2 <= time.monotonic() - started < 5
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    assert b"--timeout-body-read" in sent[1]["body"]


def test_a_body_that_never_ends_is_shed_for_a_new_connection() -> None:
    """ConnectionLimits on uvicorn, limit 2, the gated app: a request in progress is never
    closed, but one whose body stalls goes when a third connection comes, and /health on it
    is answered (before: every connection busy, uvicorn's 503 for all)."""
    import uvicorn

    from minisgl.ext.serving.connections import ConnectionLimits
    from support.server import free_port, wait_for

    app = gated(body_timeout=60)
    limits, port = ConnectionLimits(2, head_timeout=30.0), free_port()
    config = uvicorn.Config(app, port=port, http=limits.protocol(), log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "uvicorn to start")
    url = f"http://127.0.0.1:{port}"
    out: list[httpx.Response] = []
    busy = threading.Thread(target=lambda: out.append(httpx.get(f"{url}/slow", timeout=20)))
    busy.start()
    try:
        wait_for(lambda: len(server.server_state.tasks) == 1, 5, "a busy request")
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 9\r\n\r\n{")
        wait_for(lambda: len(server.server_state.tasks) == 2, 5, "the stalled body")
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # a third connection
        stalled.settimeout(5)
        assert stalled.recv(1) == b""  # shed, long before its body timeout
        stalled.close()
        app.state.release.set()
        busy.join(10)
        assert out and out[0].status_code == 200, out
    finally:
        app.state.release.set()
        server.should_exit = True
        thread.join(10)
        busy.join(10)


def test_a_request_unread_at_the_keep_alive_timeout_is_not_cut() -> None:
    """A kept-alive connection's next request came in time, but the loop was held up (a loaded
    machine) between reading the sockets and running the due timers: at the timeout its bytes
    still wait unread. The connection is looked at again, not closed (closing it with unread
    bytes resets it: a soak run saw four ReadErrors at once). A silent one is closed."""
    import uvicorn
    from uvicorn.server import ServerState

    from minisgl.ext.serving.connections import RECHECK_S, ConnectionLimits

    class Transport:
        def __init__(self, sock: socket.socket) -> None:
            self.sock, self.closed = sock, False

        def get_extra_info(self, name: str) -> Any:
            return self.sock if name == "socket" else None

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

    limits = ConnectionLimits(8, head_timeout=5.0)
    config = uvicorn.Config(gated(), http=limits.protocol(), log_level="error")
    loop = asyncio.new_event_loop()
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        conns = []
        for server_side, _ in pairs:
            protocol = limits.protocol()
            conn: Any = protocol(config, server_state=ServerState(), app_state={}, _loop=loop)
            conn.transport, conn.connections, conn.cycle = Transport(server_side), {conn}, None
            conns.append(conn)
        pairs[0][1].sendall(b"GET /health HTTP/1.1\r\n")  # sent, not yet read
        for conn in conns:
            conn.timeout_keep_alive_handler()  # uvicorn's timer: left to the limits
            assert not conn.transport.closed
            conn._head_overdue()
        assert not conns[0].transport.closed and conns[1].transport.closed
        timer = conns[0]._head_timer
        assert timer is not None and timer.when() - loop.time() <= RECHECK_S
    finally:
        loop.close()
        for pair in pairs:
            for sock in pair:
                sock.close()


def test_a_request_cut_by_the_exit_logs_one_line() -> None:
    from minisgl.ext.serving.http import _CutShort

    try:
        raise asyncio.CancelledError()
    except asyncio.CancelledError:
        cancelled = sys.exc_info()
    try:
        raise ValueError("a bug")
    except ValueError:
        bug = sys.exc_info()
    make = logging.getLogger("uvicorn.error").makeRecord
    record = make(
        "uvicorn.error", logging.ERROR, "f", 1, "Exception in ASGI application\n", (), cancelled
    )
    assert _CutShort().filter(record) and record.exc_info is None
    assert record.levelno == logging.WARNING and "server is stopping" in record.getMessage()
    record = make(
        "uvicorn.error", logging.ERROR, "f", 1, "Exception in ASGI application\n", (), bug
    )
    assert _CutShort().filter(record) and record.exc_info == bug  # a real error keeps its trace
