"""The HTTP server's gate and connections under hostile clients (issue 52): a flood of request
bodies that never end (slowloris) leaves /health and normal requests answered, a body that
does not arrive within --timeout-body-read gets 408 and loses its connection, raw bytes that
are not UTF-8 (raw surrogates included) are a 400 naming the field, Authorization is parsed as
RFC 7235 says, and exits (the watchdog's, SIGTERM's) log no traceback. The real processes on
the tiny model: one server without an API key (its last test: the watchdog's exit), one with
a key and a short body timeout (its last test: SIGTERM)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import Server, make_tiny_model, run_servers, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
KEY = "sk-gate-3b9e"
SILENT_BODIES = 2100  # over --max-connections' default (2048), as the probe that found it
HEALTH_BOUND_S = 60.0
WATCHDOG_S = 10  # long enough that a loop busy with the flood does not look like a hang
BODY_TIMEOUT_S = 2  # the keyed server's --timeout-body-read
LONG = 30000  # max_tokens of a request that runs until cut


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"), 32768)


@pytest.fixture(scope="module")
def servers(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """The module's two servers (`server`, `keyed`), started at once."""
    logs = tmp_path_factory.mktemp("logs")
    args = ("--page-size", "4", "--timeout-body-read", "120")
    args += ("--watchdog-timeout", str(WATCHDOG_S), "--shutdown-timeout", "2")
    keyed = ("--page-size", "4", "--api-key", KEY, "--timeout-body-read", str(BODY_TIMEOUT_S))
    started = [
        Server(model_dir, *args, log_path=str(logs / "gate.log")),
        Server(model_dir, *keyed, "--shutdown-timeout", "1", log_path=str(logs / "keyed.log")),
    ]
    with run_servers(*started):
        yield started


@pytest.fixture(scope="module")
def server(servers: list[Server]) -> Server:
    """No API key; bodies may take 120 s (longer than the /health bound: the flood's bodies
    are not cut by their timeout during the test). Its last test ends it (the watchdog)."""
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers: list[Server]) -> Server:
    """An API key and a short body timeout. Its last test stops it (SIGTERM)."""
    return servers[1]


def post_raw(server: Server, path: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json", **server.headers}
    return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=60)


def completes(server: Server) -> None:
    # ignore_eos: at the server's default temperature (1.0) a random model may draw its EOS
    body = b'{"prompt": "hello", "max_tokens": 2, "ignore_eos": true}'
    r = post_raw(server, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def partial_body(port: int, extra_headers: str = "") -> socket.socket:
    """A connection that sends a request's headers, announcing 100 bytes of body, then `{`."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    with contextlib.suppress(OSError):  # the server may shed it at once (over its limit)
        sock.sendall(f"{head}{extra_headers}Content-Length: 100\r\n\r\n{{".encode())
    return sock


def stream_events(server: Server, events: list[dict[str, Any]]) -> None:
    """A long streamed completion's JSON events, appended as they come; {"cut": ...} last if
    the connection broke."""
    body = {"prompt": [5, 6], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    url = f"{server.url}/v1/completions"
    try:
        with httpx.stream("POST", url, json=body, headers=server.headers, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append({"cut": repr(e)})


@contextlib.contextmanager
def open_files(n: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"the open-file limit ({hard}) is too low for {n} sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, n), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---- the server without a key -------------------------------------------------------------
def test_health_and_requests_answered_under_2100_silent_bodies(server: Server) -> None:
    """2,100 connections send a request's headers and `{` of a 100-byte body, then nothing
    (before: held for minutes, and every request, /health included, got 503 "Exceeded
    concurrency limit"). /health says 200, and a completion is served, within 60 s while they
    stay open (their body timeout is 120 s). Only the bound is asserted: 2 loaded cores."""
    sockets: list[socket.socket] = []
    with open_files(SILENT_BODIES + 500):
        try:
            for _ in range(SILENT_BODIES):
                sockets.append(partial_body(server.port))
            flooded = time.monotonic()

            def health() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
                return False

            wait_for(health, HEALTH_BOUND_S, "/health under the flood", interval=0.5)
            completes(server)
            assert time.monotonic() - flooded < HEALTH_BOUND_S
        finally:
            for sock in sockets:
                sock.close()
    assert server.wait_idle()["in_flight"] == 0
    completes(server)


# (path, body with ~ where the bytes go, the field the 400 names)
RAW_TEXT = [
    ("/v1/completions", b'{"prompt": "a~", "max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["x", "~"], "max_tokens": 4}', "stop[1]"),
    ("/v1/completions", b'{"prompt": "a", "regex": "[a-z]~", "max_tokens": 4}', "regex"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi~"}], "max_tokens": 4}',
        "messages[0].content",
    ),
    ("/generate", b'{"text": "a~", "sampling_params": {"max_new_tokens": 4}}', "text"),
    ("/generate", b'{"text": "a", "sampling_params": {"regex": "~"}}', "sampling_params.regex"),
]


@pytest.mark.parametrize("raw", [b"\xed\xa0\x80", b"\xff"], ids=["surrogate", "xff"])
def test_bytes_that_are_not_utf8_are_a_400_naming_the_field(server: Server, raw: bytes) -> None:
    """Raw surrogate bytes (json.loads takes them for a lone surrogate, which no message can
    carry: a 500 before) and any other stray byte: a 400 naming the field, then a normal
    request is served."""
    for path, body, field in RAW_TEXT:
        r = post_raw(server, path, body.replace(b"~", raw))
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_unicode" and error["param"] == field, error
        assert error["message"].startswith(f"{field}: text is not valid Unicode"), error
        completes(server)
    r = post_raw(server, "/v1/completions", b'{"prompt": "a", "max_tokens": 2' + raw + b"}")
    assert r.status_code == 400, r.text  # outside any string: the body is named
    error = r.json()["error"]
    assert error["code"] == "invalid_unicode" and error["param"] is None, error
    assert error["message"].startswith("body: "), error
    completes(server)
    assert server.wait_idle()["in_flight"] == 0


def test_watchdog_exit_logs_no_traceback(server: Server) -> None:
    """The keyless server's last test: SIGSTOP the scheduler with a stream running and a body
    still arriving: the watchdog fails the stream and the server exits with code 1, and its
    log holds no traceback (before: the lifespan's CancelledError)."""
    events: list[dict[str, Any]] = []
    streamer = threading.Thread(target=stream_events, args=(server, events), daemon=True)
    streamer.start()
    slow = None
    scheduler = server.child_pid("scheduler_0")
    try:
        wait_for(lambda: bool(events), 30, "the stream to start")
        slow = partial_body(server.port)
        os.kill(scheduler, signal.SIGSTOP)
        assert server.wait_exit(WATCHDOG_S + 30) == 1
        server.expect_code = 1
        streamer.join(10)
        assert "watchdog: no progress" in events[-1].get("error", {}).get("message", ""), events[-1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(scheduler, signal.SIGCONT)
        if slow is not None:
            slow.close()
    log = server.log()
    assert "minisgl: watchdog: no progress" in log
    assert "Traceback" not in log and "CancelledError" not in log, log


# ---- the server with a key ----------------------------------------------------------------
def test_a_body_that_does_not_arrive_gets_408_and_its_connection_closed(keyed: Server) -> None:
    sock = partial_body(keyed.port, f"Authorization: Bearer {KEY}\r\n")
    started = time.monotonic()
    try:
        sock.settimeout(BODY_TIMEOUT_S + 30)
        data = b""
        while chunk := sock.recv(65536):  # up to the server's close
            data += chunk
    finally:
        sock.close()
    assert time.monotonic() - started >= BODY_TIMEOUT_S - 0.5
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "--timeout-body-read" in error["message"]
    completes(keyed)


def test_authorization_per_rfc_7235(keyed: Server) -> None:
    url = f"{keyed.url}/v1/models"
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        r = httpx.get(url, headers={"authorization": f"{scheme} {KEY}"}, timeout=10)
        assert r.status_code == 200, (scheme, r.text)
    r = httpx.get(url, headers={"authorization": f"Bearer   {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text  # 1*SP between the scheme and the token
    for wrong in (f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer", ""):
        r = httpx.get(url, headers={"authorization": wrong}, timeout=10)
        assert r.status_code == 401, (wrong, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    # two headers, whichever order and even both right: refused, saying why
    for pair in ([f"Bearer {KEY}", "Bearer wrong"], ["Bearer wrong", f"Bearer {KEY}"]):
        two = [("authorization", pair[0]), ("authorization", pair[1])]
        r = httpx.get(url, headers=two, timeout=10)
        assert r.status_code == 401, r.text
        assert "2 Authorization headers" in r.json()["error"]["message"], r.text
    both = [("authorization", f"Bearer {KEY}")] * 2
    assert httpx.get(url, headers=both, timeout=10).status_code == 401
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200  # needs no key


def test_sigterm_exit_logs_no_traceback(keyed: Server) -> None:
    """The keyed server's last test: SIGTERM with a stream running and a body still arriving
    (--shutdown-timeout 1): the stream ends with the drain's error, the body's connection is
    closed, the exit code is 0 and the log holds no traceback."""
    events: list[dict[str, Any]] = []
    streamer = threading.Thread(target=stream_events, args=(keyed, events), daemon=True)
    streamer.start()
    slow = None
    try:
        wait_for(lambda: bool(events), 30, "the stream to start")
        slow = partial_body(keyed.port, f"Authorization: Bearer {KEY}\r\n")
        time.sleep(0.2)  # its head read, its body awaited
        keyed.proc.send_signal(signal.SIGTERM)
        assert keyed.wait_exit(30) == 0
        streamer.join(10)
        last = events[-1].get("error", {}).get("message", "")
        assert "server shut down before the request finished" in last, events[-1]
        slow.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            slow.recv(65536)  # closed (or answered): not left open
    finally:
        if slow is not None:
            slow.close()
    log = keyed.log()
    assert "Traceback" not in log and "CancelledError" not in log, log
