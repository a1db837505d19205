"""Reliability of the real server (`python -m minisgl` on a tiny model): many clients with some
leaving mid-stream, a KV pool small enough to force preemption, admission control, timeouts,
body limits, Prometheus metrics, children that die, SIGTERM draining and SIGKILL. Every test
that loads the server ends by checking that no KV page leaked and no prefix-cache lock is held."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import Server, make_tiny_model, run_servers, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
CONTEXT = 32768  # LONG then takes 10 s or more even on a fast CPU (~2,000 tokens/s alone)
LONG = CONTEXT - 100  # max_tokens of a request that runs for minutes unless cut
POOL_PAGES = 24  # the pressured server's KV pool: 96 tokens at page size 4


# ---- fixtures and helpers -----------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"), CONTEXT)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> Any:
    from minisgl import LLM

    return LLM(model_dir, page_size=4)


@pytest.fixture(scope="module")
def servers(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    """The module's three servers by name, started at once."""
    logs = tmp_path_factory.mktemp("logs")
    limits = ("--max-running-requests", "1", "--max-queued-requests", "2")
    limits += ("--request-timeout", "6", "--max-request-bytes", "4000")
    args = {
        "load": ("--shutdown-timeout", "5"),
        "pressured": ("--num-pages", str(POOL_PAGES)),
        "limited": limits,
    }
    started = {
        name: Server(model_dir, "--page-size", "4", *extra, log_path=str(logs / f"{name}.log"))
        for name, extra in args.items()
    }
    with run_servers(*started.values()):
        yield started


@pytest.fixture(scope="module")
def server(servers: dict[str, Server]) -> Server:
    return servers["load"]


@pytest.fixture(scope="module")
def pressured(servers: dict[str, Server]) -> Server:
    return servers["pressured"]


@pytest.fixture(scope="module")
def limited(servers: dict[str, Server]) -> Server:
    return servers["limited"]


def metrics(server: Server) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'minisgl_requests_finished_total{reason="stop"}'."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def assert_nothing_leaked(server: Server) -> dict[str, int]:
    """Once idle: every page is free or in the prefix cache, unlocked; none is unaccounted for."""
    s = server.wait_idle()
    assert s["leaked_pages"] == 0 and s["locked_pages"] == 0, s
    assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s
    assert metrics(server)["minisgl_kv_pages_used"] == 0
    return s


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    } | extra


async def read_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], leave_after: int | None = None
) -> tuple[str, int, bool]:
    """(text, completion tokens, reached [DONE]) of a streamed completion; leaving after
    `leave_after` chunks closes the connection mid-stream."""
    text, tokens, chunks = "", -1, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, tokens, True
            data = json.loads(line[6:])
            assert "error" not in data, data
            text += "".join(c["text"] for c in data["choices"])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            chunks += 1
            if chunks == leave_after:
                return text, tokens, False
    return text, tokens, False


# ---- many clients, some leaving ---------------------------------------------------------
def test_200_streams_with_30_percent_disconnecting(server: Server, offline: Any) -> None:
    from minisgl import SamplingParams

    rng = random.Random(8)
    n = 200
    prompts = [[rng.randrange(3, 480) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    leaving = set(rng.sample(range(n), int(0.3 * n)))
    # those that leave would run long; the others are short and checked token for token
    lengths = [LONG if i in leaving else rng.randint(4, 16) for i in range(n)]
    before = metrics(server)

    async def run_all() -> list[tuple[str, int, bool]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            return await asyncio.gather(
                *(
                    read_stream(
                        client,
                        server.url,
                        completion(p, m, stream=True, stream_options={"include_usage": True}),
                        leave_after=rng.randint(1, 3) if i in leaving else None,
                    )
                    for i, (p, m) in enumerate(zip(prompts, lengths))
                )
            )

    results = asyncio.run(run_all())
    staying = [i for i in range(n) if i not in leaving]
    refs = offline.generate(
        [prompts[i] for i in staying],
        [SamplingParams(max_tokens=lengths[i], ignore_eos=True) for i in staying],
        use_tqdm=False,
    )
    for i, ref in zip(staying, refs):
        text, tokens, done = results[i]
        assert done and tokens == lengths[i] and text == ref["text"], f"request {i}"
    assert not any(results[i][2] for i in leaving)

    assert_nothing_leaked(server)
    after = metrics(server)
    finished = 'minisgl_requests_finished_total{reason="%s"}'
    assert after[finished % "length"] - before.get(finished % "length", 0) == len(staying)
    assert after[finished % "abort"] - before.get(finished % "abort", 0) == len(leaving)


def test_non_streamed_request_is_aborted_when_its_client_leaves(server: Server) -> None:
    server.wait_idle()
    before = metrics(server)
    body = completion([9, 99, 199, 299, 399, 499], LONG)  # no other test's prompt
    # the client leaves long before LONG tokens (10 s or more)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)

    # The request ends as aborted, not as finished by length: counted by reason, which does not
    # depend on how many tokens this machine made before the server noticed.
    finished = 'minisgl_requests_finished_total{reason="%s"}'

    def aborted() -> dict[str, float] | None:
        m = metrics(server)
        return m if m.get(finished % "abort", 0) > before.get(finished % "abort", 0) else None

    after = wait_for(aborted, 10, "the abandoned request to be aborted")
    assert after[finished % "abort"] - before.get(finished % "abort", 0) == 1
    assert after.get(finished % "length", 0) == before.get(finished % "length", 0)
    assert_nothing_leaked(server)


# ---- metrics ------------------------------------------------------------------------------
def test_metrics_count_tokens_latencies_and_statuses(server: Server) -> None:
    server.wait_idle()
    before = metrics(server)
    prompt = list(range(100, 124))  # 24 tokens: 6 pages, 5 of them reusable by the repeats
    for _ in range(3):
        r = httpx.post(f"{server.url}/v1/completions", json=completion(prompt, 5), timeout=60)
        assert r.status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": []}).status_code == 400
    body = completion(prompt, 2, priority=40)  # past the labelled range: one series for all
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    server.wait_idle()
    after = metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("minisgl_prompt_tokens_total") == 4 * 24
    assert delta("minisgl_generation_tokens_total") == 3 * 5 + 2
    assert delta('minisgl_time_to_first_token_seconds_count{priority=">16"}') == 1
    for name in ("time_to_first_token", "queue_time", "e2e_request_latency"):
        assert delta(f'minisgl_{name}_seconds_count{{priority="0"}}') == 3, name
    assert delta("minisgl_inter_token_latency_seconds_count") == 3 * 4 + 1
    assert delta('minisgl_requests_finished_total{reason="length"}') == 4
    http = 'minisgl_http_requests_total{path="%s",status="%d"}'
    assert delta(http % ("/v1/completions", 200)) == 4
    assert delta(http % ("/v1/completions", 400)) == 1
    assert delta(http % ("/metrics", 200)) == 1  # the first scrape
    # the three repeats found 5 pages (20 tokens) each in the prefix cache
    assert delta("minisgl_prefill_tokens_total") == 4 * 24
    assert delta("minisgl_prefix_cache_hit_tokens_total") == 3 * 20
    assert 0 < after["minisgl_prefix_cache_hit_rate"] <= 1
    assert after["minisgl_num_running_requests"] == after["minisgl_num_queued_requests"] == 0
    assert after["minisgl_kv_pages_total"] == server.stats()["total_pages"]
    assert after["minisgl_kv_pages_leaked"] == 0
    assert after["minisgl_resident_memory_bytes"] > 50 * 2**20


# ---- a tiny KV pool -----------------------------------------------------------------------
def test_tiny_kv_pool_preempts_and_still_matches(pressured: Server, offline: Any) -> None:
    from minisgl import SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 480) for _ in range(rng.randint(4, 20))] for _ in range(12)]
    lengths = [rng.randint(20, 40) for _ in prompts]  # each fits alone; together they cannot
    assert all(len(p) + m < POOL_PAGES * 4 for p, m in zip(prompts, lengths))

    async def run_all() -> list[tuple[str, int, bool]]:
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [
                completion(p, m, stream=True, stream_options={"include_usage": True})
                for p, m in zip(prompts, lengths)
            ]
            return await asyncio.gather(*(read_stream(client, pressured.url, b) for b in bodies))

    results = asyncio.run(run_all())
    refs = offline.generate(
        prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths], use_tqdm=False
    )
    for i, ((text, tokens, done), ref) in enumerate(zip(results, refs)):
        assert done and tokens == lengths[i] and text == ref["text"], f"request {i}"
    assert pressured.stats()["num_preemptions"] > 0
    assert metrics(pressured)["minisgl_preemptions_total"] > 0
    assert_nothing_leaked(pressured)


def test_prompt_larger_than_the_kv_pool_is_refused(pressured: Server) -> None:
    body = completion(list(range(3, 3 + POOL_PAGES * 4 + 4)), 4)
    for stream in (False, True):
        r = httpx.post(f"{pressured.url}/v1/completions", json=body | {"stream": stream})
        assert r.status_code == 400, r.text
        assert "KV cache" in r.json()["error"]["message"]
    # one that fits but asks for more than the pool holds: refused with the numbers (vLLM's) ...
    r = httpx.post(f"{pressured.url}/v1/completions", json=completion([5, 6, 7], 500), timeout=60)
    assert r.status_code == 400 and "prompt (3 tokens) + max_tokens (500)" in r.text, r.text
    # ... while /generate (SGLang's) stops at the pool's size
    native = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }
    r = httpx.post(f"{pressured.url}/generate", json=native, timeout=60)
    assert r.json()["completion_tokens"] == POOL_PAGES * 4 - 3, r.text
    assert_nothing_leaked(pressured)


def test_sigkill_of_the_server_leaves_no_child(pressured: Server) -> None:
    """The pressured server's last test: killed outright, no clean-up of its own can run; the
    kernel takes its children down (PR_SET_PDEATHSIG)."""
    pressured.expect_code = -signal.SIGKILL
    pressured.proc.kill()
    pressured.proc.wait()
    pressured.assert_no_survivors(grace=5)


# ---- admission control, timeouts, body size -----------------------------------------------
def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def stream_events(
    url: str, body: dict[str, Any], events: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The JSON events of a streamed completion; {"cut": ...} last if the connection broke; a
    request refused before its stream began (an HTTP error, not SSE) gives its error body as
    the one event. Events are appended to `events` as they arrive, so another thread can
    watch progress."""
    events = [] if events is None else events
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                events.append({**json.loads(r.read()), "status": r.status_code})
                return events
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append({"cut": repr(e)})
    return events


TIMEOUTS = 'minisgl_requests_finished_total{reason="timeout"}'


class Filled(NamedTuple):
    started: float
    timeouts_before: float  # the server's count of timed-out requests before these
    running: threading.Thread
    events: list[Any]  # the running request's stream
    waiting: list[tuple[threading.Thread, list[Any]]]


def fill_the_queue(limited: Server) -> Filled | None:
    """One request running, two queued; None when that took 5 s or more, so the first could
    time out (6 s) before the refusal is checked: the three have then ended, the server is
    idle again."""
    url = limited.url
    timeouts_before = metrics(limited).get(TIMEOUTS, 0.0)
    started = time.monotonic()
    running, events = in_thread(stream_events, url, completion([5, 6], LONG, stream=True))
    wait_for(lambda: limited.stats()["running"] == 1, 10, "the first request to run")
    # long, so that they cannot finish in the moment between the first one's end and their own
    waiting = [
        in_thread(
            lambda i: httpx.post(
                f"{url}/v1/completions", json=completion([7, i], LONG), timeout=60
            ),
            i,
        )
        for i in range(2)
    ]

    def queued() -> dict[str, float] | None:  # one read: the gauges of one moment
        m = metrics(limited)
        counts = (m["minisgl_num_running_requests"], m["minisgl_num_queued_requests"])
        return m if counts == (1, 2) else None

    m = wait_for(queued, 10, "one request running and two queued")
    assert 0 < m["minisgl_kv_pages_used"] <= m["minisgl_kv_pages_total"], m
    if time.monotonic() - started < 5:
        return Filled(started, timeouts_before, running, events, waiting)
    for thread in [running] + [t for t, _ in waiting]:  # a loaded machine: they time out
        thread.join(20)
    limited.wait_idle()
    return None


def test_overload_gets_503_and_slow_requests_time_out(limited: Server) -> None:
    """One request runs (--max-running-requests 1), two wait (--max-queued-requests 2): the
    next gets 503 + Retry-After. After 6 s (--request-timeout) all three end with 504 (6 s: the
    two must be queued and the fourth refused before the first times out; a loaded 2-core
    machine that took longer than 5 s to queue them gets a second try; the first must not
    finish its LONG tokens before)."""
    url = limited.url
    filled = fill_the_queue(limited) or fill_the_queue(limited)
    assert filled is not None, "twice too slow to fill the queue before the timeout"
    started, timeouts_before, running, events, waiting = filled
    r = httpx.post(f"{url}/v1/completions", json=completion([8], 8))
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "overloaded"
    assert r.json()["error"]["type"] == "server_error"
    r = httpx.post(f"{url}/generate", json={"input_ids": [8], "stream": True})
    assert r.status_code == 503

    running.join(20)
    assert 5.5 < time.monotonic() - started < 14
    assert events[0][-1]["error"]["code"] == "timeout", events[0][-1]
    assert all("choices" in e for e in events[0][:-1]) and len(events[0]) > 1
    for thread, out in waiting:
        thread.join(20)
        assert out[0].status_code == 504, out[0].text
        assert "timed out after 6 s" in out[0].json()["error"]["message"]
    assert_nothing_leaked(limited)
    assert metrics(limited)[TIMEOUTS] - timeouts_before == 3
    # with the queue empty again, requests are served
    r = httpx.post(f"{url}/v1/completions", json=completion([8], 8), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_request_body_size_limit(limited: Server) -> None:
    url = f"{limited.url}/v1/completions"
    big = completion(list(range(5, 1500)), 4)  # over 4000 bytes of JSON
    r = httpx.post(url, json=big)
    assert r.status_code == 413 and "4000 bytes" in r.json()["error"]["message"], r.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    r = httpx.post(url, json=completion(list(range(5, 100)), 4), timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{limited.url}/health").status_code == 200


# ---- the soak script ----------------------------------------------------------------------
def test_soak_script_briefly(server: Server) -> None:
    from support.server import REPO

    cmd = [sys.executable, os.path.join(REPO, "scripts", "soak.py"), "--url", server.url]
    cmd += ["--duration", "4", "--concurrency", "6", "--warmup", "1", "--report-every", "2"]
    # one timed 512-token answer, not the fastest of three (seconds): one slow run only makes
    # the leaving clients wait longer, still far short of their answers 8x as long
    cmd += ["--calibrate-runs", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pages leaked: 0 (locked prefix-cache pages: 0)" in out.stdout
    assert "errors by kind: none" in out.stdout and "soak: OK" in out.stdout
    done = re.search(r"requests done: (\d+)", out.stdout)
    assert done and int(done.group(1)) >= 6, out.stdout  # 9 on a slow CI machine


# ---- stopping -----------------------------------------------------------------------------
def test_sigterm_drains_in_flight_requests(server: Server) -> None:
    """The load server's last test: on SIGTERM a short request in flight completes; a long one
    ends with an error event at the end of --shutdown-timeout (5 s: room for the short one on a
    slow machine); exit code 0, no process left."""
    long_, long_out = in_thread(stream_events, server.url, completion([3, 5], LONG, stream=True))
    wait_for(lambda: server.stats()["running"] >= 1, 30, "the long request to run")
    # The short one is signalled once it streams; on a loaded machine it may already be done,
    # which still checks that the drain lets finished work through.
    short_events: list[dict[str, Any]] = []
    body = completion([3, 4], 30, stream=True)
    short, short_out = in_thread(stream_events, server.url, body, short_events)
    wait_for(lambda: len(short_events) > 0, 30, "the short request to stream")
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    short.join(15)
    events = short_out[0]
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    assert "".join(e["choices"][0]["text"] for e in events)
    assert server.wait_exit(15) == 0
    assert 4.5 < time.monotonic() - started < 15
    assert server.stop() == 0  # checks that no process survived
    long_.join(5)
    last = long_out[0][-1]  # the documented error event, not a bare close
    assert "server shut down before the request finished" in last["error"]["message"], last


def outcome(url: str, stream: bool) -> str:
    """What a client of a long request ends with: the error it got, or how its connection ended."""
    body = completion([5, 6], LONG, stream=stream)
    if stream:
        last = stream_events(url, body)[-1]
        return last.get("error", {}).get("message", f"no error: {last}")
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    except httpx.HTTPError as e:
        return f"connection error {e!r}"
    return f"{r.status_code} {r.json()['error']['message']}"


@pytest.mark.parametrize("victim", ["scheduler_0", "tokenizer_0", "detokenizer"])
def test_dead_child_fails_requests_and_stops_the_server(
    model_dir: str, tmp_path: Any, victim: str
) -> None:
    """SIGKILL a child under load: every client gets an error, /health turns 503, the server
    exits with code 1 within 5 s and leaves no process behind."""
    server = Server(model_dir, "--page-size", "4", log_path=str(tmp_path / f"{victim}.log"))
    try:
        server.wait_ready()
        clients = [in_thread(outcome, server.url, s) for s in (True, True, True, False, False)]
        wait_for(lambda: server.stats()["running"] == 5, 30, "the load to run")
        killed = time.monotonic()
        os.kill(server.child_pid(victim), signal.SIGKILL)

        def unhealthy() -> bool:
            try:
                return httpx.get(f"{server.url}/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                raise AssertionError("the server went away before /health said 503") from None

        wait_for(unhealthy, 2, "/health to turn 503", interval=0.02)
        assert server.wait_exit(timeout=10) == 1
        assert time.monotonic() - killed < 5
        assert f"minisgl: {victim} process died (exit code -9)" in server.log()
        for thread, out in clients:
            thread.join(5)
            assert out and f"{victim} process died" in out[0], out
        assert sum(o[0].startswith("503 ") for _, o in clients) == 2  # the non-streamed ones
        assert server.stop() == 1  # nothing left to signal: checks that no process survived
    finally:
        if server.proc.poll() is None:
            server.kill_all()


# ---- the detokenizer survives a failing request -------------------------------------------
class SentList:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def put(self, msg: Any) -> None:
        self.sent.append(msg)


class FlakyTokenizer:
    """Decodes ids as letters; token 13 makes decode raise (think: a tokenizer bug)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if 13 in ids:
            raise RuntimeError("unlucky token")
        return "".join(chr(97 + i % 26) for i in ids)


def test_detokenizer_failure_ends_only_that_request() -> None:
    from minisgl.message import AbortBackendMsg, DetokenizeMsg, DetokInitMsg
    from minisgl.tokenizer.detokenize import Detokenizer

    to_sched = SentList()
    worker = Detokenizer(FlakyTokenizer(), SentList(), [to_sched])  # type: ignore[arg-type]
    for uid in (1, 2):
        assert worker.init(DetokInitMsg(uid, 3, [0, 1, 2])) == []
    ok = worker.guarded(DetokenizeMsg(1, [3], False, None))
    bad = worker.guarded(DetokenizeMsg(2, [13], False, None))
    assert ok is not None and ok.text_delta == "d" and not ok.finished
    assert bad is not None and bad.finished and bad.finish_reason == "error"
    assert bad.error is not None and "unlucky token" in bad.error and bad.prompt_tokens == 3
    assert to_sched.sent == [AbortBackendMsg(2)]  # the scheduler stops generating for it
    # tokens already on their way are dropped; the abort's echo forgets the request
    assert worker.guarded(DetokenizeMsg(2, [4], False, None)) is None
    assert worker.guarded(DetokenizeMsg(2, [], True, "abort")) is None
    assert 2 not in worker.states and not worker.early
    last = worker.guarded(DetokenizeMsg(1, [4], True, "length"))
    assert last is not None and last.text_delta == "e" and last.finished
    assert worker.states == {}
    # a failure on the request's last message needs no abort
    worker.init(DetokInitMsg(3, 1, [0]))
    assert worker.guarded(DetokenizeMsg(3, [13], True, "length")).finish_reason == "error"  # type: ignore[union-attr]
    assert worker.states == {} and len(to_sched.sent) == 1
