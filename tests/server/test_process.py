"""The server as a set of processes (issue 18): the watchdog of a hung pipeline,
/health?generate=1, worker titles, the API key from the environment, no listener beyond
loopback with TP, bounded idle connections, internal messages that do not decode, and the temp
directory after kill -9 of the main process. Each test ends with no process left behind."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import REPO, Server, descendants, make_tiny_model, run_server, title, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
CONTEXT = 32768  # LONG then runs 10 s or more even on a fast CPU (~2,000 tokens/s alone)
LONG = CONTEXT - 100  # max_tokens of a request that runs for minutes unless cut
KEY = "sk-test-7f3a9c1e5b"
IDLE_SOCKETS = 1500
MAX_CONNECTIONS = 300  # the shared server's: fewer than IDLE_SOCKETS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"), CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No watchdog (a test stops a worker on purpose), a short health check and keep-alive, few
    connections, the API key from the environment, an open-file limit that does not fit
    uvicorn's backlog three times over. Its last test kills it with SIGKILL."""
    log = str(tmp_path_factory.mktemp("logs") / "process.log")
    args = ["--page-size", "4", "--watchdog-timeout", "0", "--health-check-timeout", "2"]
    args += ["--timeout-keep-alive", "2", "--max-connections", str(MAX_CONNECTIONS)]
    env = {"MINISGL_API_KEY": KEY}
    with run_server(model_dir, *args, log_path=log, extra_env=env, max_open_files=4096) as s:
        yield s


def completion(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": [5, 6],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    } | extra


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def stream_events(url: str, events: list[dict[str, Any]]) -> None:
    """The JSON events of a long streamed completion, appended as they come; {"cut": ...} last
    if the connection broke."""
    body = completion(LONG, stream=True)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append({"cut": repr(e)})


def post_long(url: str) -> httpx.Response | str:
    try:
        return httpx.post(f"{url}/v1/completions", json=completion(LONG), timeout=60)
    except httpx.HTTPError as e:
        return repr(e)


def health(server: Server, query: str = "") -> httpx.Response:
    return httpx.get(f"{server.url}/health{query}", timeout=10)


# ---- the watchdog -------------------------------------------------------------------------
def test_watchdog_fails_requests_and_exits_when_the_scheduler_hangs(
    model_dir: str, tmp_path: Any
) -> None:
    """SIGSTOP the scheduler under load (--watchdog-timeout 3, as test_api_servers' hung
    scheduler): the stream ends with an error event, the plain request gets a JSON 503, /health
    turns 503 and the server exits with code 1 within 15 s, leaving no process behind."""
    log = str(tmp_path / "watchdog.log")
    server = Server(model_dir, "--page-size", "4", "--watchdog-timeout", "3", log_path=log)
    scheduler = None
    try:
        server.wait_ready()
        events: list[dict[str, Any]] = []
        streamer, _ = in_thread(stream_events, server.url, events)
        plain, plain_out = in_thread(post_long, server.url)
        wait_for(lambda: bool(events) and server.stats()["running"] == 2, 30, "both to run")
        scheduler = server.child_pid("scheduler_0")
        os.kill(scheduler, signal.SIGSTOP)
        stopped = time.monotonic()
        statuses: list[int] = []

        def unhealthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                statuses.append(health(server).status_code)
            return statuses[-1:] == [503] or server.proc.poll() is not None

        wait_for(unhealthy, 15, "/health to turn 503", interval=0.05)
        assert statuses[-1] == 503, statuses
        assert server.wait_exit(15) == 1
        assert time.monotonic() - stopped < 15
        streamer.join(5)
        plain.join(5)
        assert "watchdog: no progress" in events[-1]["error"]["message"], events[-1]
        response = plain_out[0]
        assert isinstance(response, httpx.Response) and response.status_code == 503, response
        assert "watchdog: no progress" in response.json()["error"]["message"]
        assert "minisgl: watchdog: no progress" in server.log()
        assert server.stop() == 1  # the process is gone: checks that none of its children is left
    finally:
        if scheduler is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(scheduler, signal.SIGCONT)
        if server.proc.poll() is None:
            server.kill_all()


# ---- the shared server --------------------------------------------------------------------
def test_workers_carry_titles(server: Server) -> None:
    procs = descendants(server.proc.pid)
    titles = {title(pid) for pid, _ in procs}
    expected = {"scheduler_0", "detokenizer", "tokenizer_0", "reaper"}
    assert {f"minisgl::{name}" for name in expected} <= titles, titles
    with open(f"/proc/{server.child_pid('detokenizer')}/comm") as f:
        assert f.read().strip() == "minisgl::detoke"  # what top shows: the kernel keeps 15 bytes


def test_api_key_from_the_environment(server: Server) -> None:
    """MINISGL_API_KEY is enforced, and found in no log, no response and no command line."""
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401, r.text
    body = completion(2)
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    for path in ("/stats", "/metrics", "/v1/models", "/openapi.json", "/health"):
        r = httpx.get(f"{server.url}{path}", headers=server.headers, timeout=10)
        assert r.status_code == 200 and KEY not in r.text, path
    for pid in [server.proc.pid, *(pid for pid, _ in descendants(server.proc.pid))]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read(), pid
    assert KEY not in server.log()


def test_health_generate_sees_a_hung_worker(server: Server) -> None:
    """/health?generate=1 runs a token through every process: a stopped tokenizer worker makes
    it 503 within --health-check-timeout (2 s), where a plain /health still says 200."""
    assert health(server, "?generate=1").json() == {"status": "ok"}
    r = health(server, "?generate=maybe")
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.generate", r.text
    tokenizer = server.child_pid("tokenizer_0")
    os.kill(tokenizer, signal.SIGSTOP)
    try:
        assert health(server).status_code == 200
        r = health(server, "?generate=1")
        assert r.status_code == 503, r.text
        assert "timed out after 2 s" in r.json()["error"]["message"]
    finally:
        os.kill(tokenizer, signal.SIGCONT)
    assert health(server, "?generate=1").status_code == 200
    assert server.wait_idle()["in_flight"] == 0


def test_api_key_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.ext.serving.options import serving_options
    from minisgl.server.args import parse_args

    def key(argv: list[str]) -> str | None:
        return serving_options(parse_args(argv)).api_key

    monkeypatch.setenv("MINISGL_API_KEY", KEY)
    assert key([]) == KEY
    assert key(["--api-key", "from-the-flag"]) == "from-the-flag"  # the flag wins
    monkeypatch.setenv("MINISGL_API_KEY", "")
    assert key([]) is None  # empty: no key


def test_undecodable_internal_messages_are_dropped(server: Server) -> None:
    """Bytes that are no message, pushed into every internal socket, are logged and dropped, and
    a request whose fields have the wrong types ends with an error: every process lives on and
    requests still work."""
    import msgpack
    import zmq

    from minisgl.core import SamplingParams
    from minisgl.message import UserMsg, encode

    found = re.search(r"sockets in (\S+)", server.log())
    assert found, server.log()
    context = zmq.Context()
    try:
        for name in ("scheduler", "detokenizer", "tokenizer0", "api"):
            sock = context.socket(zmq.PUSH)
            sock.connect(f"ipc://{os.path.join(found.group(1), name)}")
            for junk in (b"\xc1\x00 not msgpack", msgpack.packb({"kind": 99})):
                sock.send(junk)
            if name == "scheduler":  # decodes, but its prompt is no list of token ids
                sock.send(encode(UserMsg(10**9, ["x"], SamplingParams())))  # type: ignore[list-item]
            sock.close(linger=2000)
    finally:
        context.term()
    wait_for(lambda: server.log().count("does not decode") >= 4, 10, "the drops to be logged")
    body = completion(3)
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def stream_until(server: Server, stop: threading.Event, events: list[dict[str, Any]]) -> None:
    """Read a long stream until `stop` is set (then leave); {"cut": ...} if it broke first."""
    body, url = completion(LONG, stream=True), f"{server.url}/v1/completions"
    try:
        with httpx.stream("POST", url, json=body, headers=server.headers, timeout=60) as r:
            for line in r.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append({"cut": repr(e)})


def test_idle_connections_are_shed_without_flooding_the_log(server: Server) -> None:
    """1500 idle sockets, over --max-connections (300): the oldest are closed as new ones come,
    never the one of a stream in progress; /health still answers, every socket that sends
    nothing is closed after --timeout-keep-alive (2 s), and the log barely grows."""
    stop, events = threading.Event(), []  # type: ignore[var-annotated]
    streamer = threading.Thread(target=stream_until, args=(server, stop, events))
    streamer.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE_SOCKETS + 200:
        pytest.skip(f"the open-file limit ({hard}) is too low for {IDLE_SOCKETS} sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, IDLE_SOCKETS + 200), hard))
    log_before = os.path.getsize(server.log_path)
    sockets: list[socket.socket] = []
    try:
        wait_for(lambda: bool(events), 30, "the stream to start")
        for _ in range(IDLE_SOCKETS):
            sockets.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        assert health(server).status_code == 200
        deadline = time.monotonic() + 15
        for s in sockets:  # each one sees the server close it: EOF (or a reset)
            s.settimeout(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1) == b""
        streamed = len(events)
        wait_for(lambda: len(events) > streamed, 10, "the stream to go on")
    finally:
        for s in sockets:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        stop.set()
        streamer.join(10)
    assert events and all("cut" not in e for e in events), events[-1:]
    assert health(server).status_code == 200
    grown = os.path.getsize(server.log_path) - log_before
    assert grown < 20_000, f"the log grew by {grown} bytes"
    assert re.search(r"closed \d+ idle HTTP connections", server.log())


def test_connection_limits_on_uvicorn() -> None:
    """`ConnectionLimits` on a bare uvicorn app, limit 2: a new connection closes the one idle
    the longest, not the other; a socket that sends nothing is closed after the head timeout;
    busy connections are never closed, and with both busy the request beyond gets uvicorn's
    503."""
    import uvicorn

    from minisgl.ext.serving.connections import ConnectionLimits
    from support.server import free_port

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(20 if scope["path"] == "/slow" else 0):  # busy for 2 s
            await send({"type": "http.response.body", "body": b".", "more_body": True})
            await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"ok"})

    limits, port = ConnectionLimits(2, head_timeout=30.0), free_port()
    config = uvicorn.Config(
        app, port=port, http=limits.protocol(), limit_concurrency=3, log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "uvicorn to start")
    url = f"http://127.0.0.1:{port}"
    try:
        old = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.1)  # accepted first: the longest idle
        young = socket.create_connection(("127.0.0.1", port))
        assert httpx.get(f"{url}/", timeout=5).status_code == 200  # a third: `old` goes
        old.settimeout(5)  # long before its head timeout
        assert old.recv(1) == b""
        young.setblocking(False)
        with pytest.raises(BlockingIOError):  # still open
            young.recv(1)
        limits.head_timeout = 0.5
        silent = socket.create_connection(("127.0.0.1", port))
        silent.settimeout(5)  # sends nothing for longer than its head timeout: closed
        assert silent.recv(1) == b""
        young.close()
        busy = [in_thread(lambda: httpx.get(f"{url}/slow", timeout=10)) for _ in range(2)]
        wait_for(lambda: len(server.server_state.tasks) == 2, 5, "two busy requests")
        assert httpx.get(f"{url}/", timeout=5).status_code == 503
        for t, out in busy:
            t.join(10)
            assert out[0].status_code == 200 and out[0].text.endswith("ok"), out
        assert httpx.get(f"{url}/", timeout=5).status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize(("files", "expected"), [(1024, (384, 128)), (9000, (2048, 2048))])
def test_connection_budget_fits_the_open_file_limit(files: int, expected: tuple[int, int]) -> None:
    """(connections, listen backlog) for --max-connections 2048 under an open-file limit:
    room for three backlogs of accepted sockets on top of the connections, or fewer of both."""
    if files > resource.getrlimit(resource.RLIMIT_NOFILE)[1]:
        pytest.skip(f"the hard open-file limit is below {files}")
    code = "from minisgl.ext.serving.connections import connection_budget as b; print(b(2048))"
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))  # noqa: E731
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, preexec_fn=limit, capture_output=True, text=True
    )
    assert out.stdout.strip() == str(expected), out.stderr


def test_gc_threshold_reaches_every_worker(server: Server) -> None:
    """The server's GC thresholds (its default, 700 10 1000, as --gc-threshold would set them)
    reach every server process: each says, once ready, the thresholds it set (the API server's
    main process, the tokenizer, the detokenizer and the scheduler), in the server's log format
    (spawned workers log at --log-level too). (The shared server: none of its flags touches
    the collector.)"""
    log = server.log()
    said = re.findall(
        r"(main process|minisgl::\S+) \(pid \d+\): garbage-collection thresholds \((.*)\)", log
    )
    names = {name for name, _ in said}
    assert {"main process", "minisgl::scheduler_0", "minisgl::detokenizer"} <= names, said
    assert any(name.startswith("minisgl::tokenizer") for name in names), said
    assert {counts for _, counts in said} == {"700, 10, 1000"}
    assert "INFO KV cache:" in log  # --log-level reaches the workers' own logging (info here)


def test_sigkill_of_the_main_process_removes_its_temp_directory(server: Server) -> None:
    """The shared server's last test: killed outright, it cannot clean up; its children die
    with it (PR_SET_PDEATHSIG) and the reaper removes the directory of its sockets."""
    found = re.search(r"sockets in (\S+)", server.log())
    assert found and os.path.isdir(found.group(1)), server.log()
    server.expect_code = -signal.SIGKILL
    server.proc.kill()
    server.proc.wait()
    server.assert_no_survivors(grace=5)
    wait_for(lambda: not os.path.exists(found.group(1)), 5, "the temp directory to go")


# ---- tensor parallelism -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`--tp 2 --device cpu` with an API key, and --gc-warning-threshold-secs 1e-9 (one start
    for two tests: the warnings only add log lines, which the TP test does not read)."""
    args = ("--tp", "2", "--device", "cpu", "--page-size", "4", "--api-key", KEY)
    args += ("--gc-warning-threshold-secs", "1e-9")
    with run_server(
        model_dir, *args, log_path=str(tmp_path_factory.mktemp("logs") / "tp.log")
    ) as s:
        yield s


def test_gc_warning_threshold_reaches_every_worker(tp_server: Server) -> None:
    """--gc-warning-threshold-secs reaches the spawned workers: the scheduler, busy while a
    request runs, logs its collections over it under its own name. (Whether a process
    collects at all while one request runs depends on its net allocations: the API process
    may not; the threshold's own checks are in tests/unit/test_procs.py.)"""
    server = tp_server
    body = {"prompt": list(range(5, 60)), "max_tokens": 40, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    warned = re.findall(
        r"(main process|minisgl::\S+) \(pid \d+\): a generation-\d garbage", server.log()
    )
    assert "minisgl::scheduler_0" in warned, set(warned)


def test_tp_listens_on_loopback_only(tp_server: Server) -> None:
    """`--tp 2 --device cpu`: the ranks meet through a file, gloo binds to loopback; the only
    listener is the HTTP server on --host. --api-key is masked in the command line."""
    import psutil

    server = tp_server
    r = httpx.post(
        f"{server.url}/v1/completions", json=completion(3), headers=server.headers, timeout=60
    )
    assert r.status_code == 200, r.text
    pids = [server.proc.pid, *(pid for pid, _ in descendants(server.proc.pid))]
    assert {"minisgl::scheduler_0", "minisgl::scheduler_1"} <= {title(p) for p in pids}
    bound = [
        (pid, c.laddr.ip, c.laddr.port)
        for pid in pids
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)
    ]
    assert (server.proc.pid, "127.0.0.1", server.port) in bound, bound
    assert all(ipaddress.ip_address(ip).is_loopback for _, ip, _ in bound), bound
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        command = f.read()
    assert KEY.encode() not in command and b"--api-key ***" in command, command
