"""--api-server-count: several HTTP API processes on one port. The pipeline routes each reply
to the process that took its request and the scheduler's stats to all of them; /stats and
/metrics add up what every process counts; a failure anywhere ends the requests of every
process with an error; SIGTERM drains them all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import Server, make_tiny_model, run_server, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
CONTEXT = 8192
# the module server's streams: long enough to be seen in flight on both processes at once
# (the poll is every 0.1 s), short enough to be cheap (issue 47: every token is an SSE event)
STREAM_TOKENS = 200


class SentList:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def put(self, msg: Any) -> None:
        self.sent.append(msg)


# ---- the parts, without a server ------------------------------------------------------------
def test_replies_go_back_to_the_process_that_took_the_request() -> None:
    from minisgl.ext.serving.apis import ApiQueues
    from minisgl.ext.serving.flush import FlushCacheReply
    from minisgl.message import BatchMsg, SchedulerStats, UserReply

    queues = [SentList(), SentList(), SentList()]
    to_api = ApiQueues(queues)
    replies = [UserReply(uid, "x", [1], False, None, 1, 1) for uid in (0, 1, 4, 7, 9)]
    stats = SchedulerStats(running=5)
    to_api.put(BatchMsg(replies, stats))
    got = [[r.uid for m in q.sent for r in m.msgs] for q in queues]
    assert got == [[0, 9], [1, 4, 7], []]
    assert all(q.sent[0].stats == stats for q in queues)  # the stats reach every process
    to_api.put(BatchMsg([replies[1]]))  # no stats: only the one that has a reply gets a message
    assert [len(q.sent) for q in queues] == [1, 2, 1]
    to_api.put(FlushCacheReply(0, None, api_rank=2))
    assert isinstance(queues[2].sent[-1], FlushCacheReply)
    to_api.put(FlushCacheReply(0, None, api_rank=5))  # no such process: dropped
    assert [len(q.sent) for q in queues] == [1, 2, 2]


def observe_some(metrics: Any, seed: int) -> None:
    import random

    rng = random.Random(seed)
    for _ in range(50):
        priority = rng.choice(["0", "1", "-3"][: 1 + seed % 3])
        metrics.ttft.labels(priority).observe(rng.random())
        metrics.itl.observe(rng.random() / 10, rng.randint(1, 5))
        metrics.generation_tokens.inc(rng.randint(1, 9))
        metrics.finished.labels(rng.choice(["stop", "length", "abort"])).inc()
        metrics.http.labels("/v1/completions", rng.choice(["200", "400"])).inc()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_summed_metrics_are_those_of_one_process_that_saw_everything() -> None:
    """Three processes' series (labels only some of them have included) summed equal one
    registry that observed all of it; each process's queued count adds up, the RSS is rank 0's."""
    from minisgl.ext.serving.metrics import Metrics, summed_exposition

    parts = [Metrics(list, lambda k=k: k + 1, lambda k=k: 100 if k == 0 else 0) for k in range(3)]
    whole = Metrics(list, lambda: 6, lambda: 100)
    for seed, m in enumerate(parts):
        observe_some(m, seed)
        observe_some(whole, seed)
    summed = summed_exposition([m.request_text() for m in parts]).decode()
    assert samples(summed) == pytest.approx(samples(whole.request_text()))  # sums: rounding
    rendered = parts[1].render([parts[0].request_text(), parts[2].request_text()]).decode()
    assert samples(summed).items() <= samples(rendered).items()
    assert "minisgl_kv_pages_total" in rendered  # the scheduler's series follow


def test_api_processes_number_their_requests_apart_and_answer_each_other(tmp_path: Any) -> None:
    """Rank k of 3 numbers its requests k, k + 3...; rank 0 gathers every process's view; a
    failure sent to rank 1 ends its requests, one sent to rank 0 goes to the launcher."""
    from minisgl.core import SamplingParams
    from minisgl.ext.serving.frontend import ApiFailMsg, ServingFrontend
    from minisgl.message import TokenizeMsg
    from minisgl.utils.zmq import ZmqAsyncPushQueue

    addrs = [f"ipc://{tmp_path}/api{k}" for k in range(3)]
    hung: list[str] = []

    async def main() -> None:
        fronts = [
            ServingFrontend([f"ipc://{tmp_path}/tok"], addrs[k], 0, hung.append, None, k, addrs)
            for k in range(3)
        ]
        for f in fronts:
            f.start()
        assert [fronts[1].new_uid() for _ in range(3)] == [1, 4, 7]
        msg = TokenizeMsg(fronts[1].new_uid(), "hi", None, None, SamplingParams())
        queue: asyncio.Queue = asyncio.Queue()
        await fronts[1].submit(msg, queue)
        views = await fronts[0].views()
        assert [(v.rank, v.in_flight, v.queued) for v in views] == [(0, 0, 0), (1, 1, 1), (2, 0, 0)]
        assert views[0].pid == os.getpid() and not views[2].metrics  # /stats: counts only
        views = await fronts[2].views(metrics=True)
        assert all("minisgl_generation_tokens" in v.metrics for v in views)
        await ZmqAsyncPushQueue(addrs[1], create=False).put(ApiFailMsg("the scheduler died"))
        reply = await asyncio.wait_for(queue.get(), 10)
        assert reply.finished and reply.error == "the scheduler died"
        await ZmqAsyncPushQueue(addrs[0], create=False).put(ApiFailMsg("api_server_2 hung"))
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_for(lambda: hung or None, 10, "rank 0 to call the launcher")
        )
        assert hung == ["api_server_2 hung"] and fronts[0].dead is None

    asyncio.run(main())


def test_each_api_process_admits_its_share_of_the_queue_limit(tmp_path: Any) -> None:
    """--max-queued-requests 5 over 2 API processes: each admits 3 waiting requests."""
    from minisgl.ext.serving.frontend import ServingFrontend
    from minisgl.server.frontend import _InFlight
    from minisgl.server.protocol import APIError

    addrs = [f"ipc://{tmp_path}/api{k}" for k in range(2)]

    async def main() -> None:
        tok = [f"ipc://{tmp_path}/tok"]
        frontend = ServingFrontend(tok, addrs[0], api_addrs=addrs, max_queued_requests=5)
        for queued in range(3):
            assert frontend.num_queued == queued
            frontend.admit()
            frontend.requests[queued] = _InFlight(asyncio.Queue())  # waiting for its first token
        with pytest.raises(APIError, match=r"limit 3\)"):
            frontend.admit()
        frontend.requests[0].last_token = 1.0  # one started: room for one more
        frontend.admit()
        for q in (frontend.recv, *frontend.to_tokenizers, *frontend.to_peers.values()):
            q.close()

    asyncio.run(main())


def test_api_server_count_is_refused_with_the_shell(capsys: Any) -> None:
    from minisgl.server.args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--shell", "--api-server-count", "2"])
    assert exc.value.code == 2
    assert "error: argument --api-server-count: is for the HTTP server" in capsys.readouterr().err


# ---- a server with two API processes --------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"), CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("logs") / "two.log")
    # a drain as long as the streams need: on two loaded cores they took over 60 s (CI flakes)
    args = ("--page-size", "4", "--api-server-count", "2", "--shutdown-timeout", "600")
    with run_server(model_dir, *args, log_path=log) as s:
        yield s


def stream(url: str, max_tokens: int, seed: int, events: list[dict[str, Any]]) -> None:
    """A streamed completion's JSON events, appended as they come; {"cut": ...} if it broke."""
    body = {"prompt": [5, 6, seed % 200], "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                events.append({**json.loads(r.read()), "status": r.status_code})
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append({"cut": repr(e)})


def streams(url: str, count: int, max_tokens: int) -> tuple[list[threading.Thread], list[Any]]:
    outs: list[list[dict[str, Any]]] = [[] for _ in range(count)]
    threads = [
        threading.Thread(target=stream, args=(url, max_tokens, i, outs[i]), daemon=True)
        for i in range(count)
    ]
    for t in threads:
        t.start()
    return threads, outs


def streams_on_both(server: Server, count: int, max_tokens: int) -> tuple[list[Any], list[Any]]:
    """`count` streams, and two more whenever all have answered while one API process has none
    in flight, until a moment when both have some and every stream has answered (so none is
    still connecting: a SIGTERM then would refuse it): the kernel hashes each connection to a
    process, so all of 8 land on one about once in 128 tries."""
    threads, outs = streams(server.url, count, max_tokens)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        both = all(p["in_flight"] > 0 for p in server.stats()["api_servers"])
        if both and all(outs):
            return threads, outs
        if all(outs) and len(outs) < 4 * count:
            more, more_outs = streams(server.url, 2, max_tokens)
            threads, outs = threads + more, outs + more_outs
        time.sleep(0.1)
    raise AssertionError("no moment with streams in flight on both API processes")


def metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(v for (n, _), v in samples(text).items() if n == name)


def test_streams_spread_over_both_processes_and_every_count_adds_up(server: Server) -> None:
    before = metric(server, "minisgl_generation_tokens_total")
    threads, outs = streams_on_both(server, 12, STREAM_TOKENS)
    for t in threads:
        t.join(120)
    usages = [o[-1].get("usage") for o in outs]
    assert all(u is not None and u["completion_tokens"] == STREAM_TOKENS for u in usages), outs[0]
    stats = server.wait_idle()
    assert stats["leaked_pages"] == 0 and stats["in_flight"] == 0
    assert [p["rank"] for p in stats["api_servers"]] == [0, 1]
    assert metric(server, "minisgl_generation_tokens_total") - before == len(outs) * STREAM_TOKENS
    for _ in range(4):  # new connections, so both processes ask; each gets its own answer
        r = httpx.post(f"{server.url}/flush_cache", timeout=30)
        assert r.status_code == 200, r.text


def test_soak_over_both_processes(server: Server) -> None:
    """scripts/soak.py's mix (good, bad and leaving clients) against two API processes: no
    unexpected outcome, no leaked page, /stats idle across both afterwards."""
    import subprocess
    import sys

    from support.server import REPO

    cmd = [sys.executable, os.path.join(REPO, "scripts", "soak.py"), "--url", server.url]
    cmd += ["--duration", "4", "--concurrency", "8", "--warmup", "1", "--report-every", "2"]
    # one timed 512-token answer, not the fastest of three (seconds): one slow run only makes
    # the leaving clients wait longer, still far short of their answers 8x as long
    cmd += ["--calibrate-runs", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "errors by kind: none" in out.stdout and "soak: OK" in out.stdout


def test_sigterm_drains_the_streams_of_both_processes(server: Server) -> None:
    """The module server's last test: streams on both processes finish during the drain, and
    meanwhile new connections are refused at once (no socket of the port is left listening).
    The scheduler is held (SIGSTOP) from before the SIGTERM until the refusal is seen, so the
    streams are still running then however fast or slow the machine is."""

    def refused() -> bool:
        try:
            httpx.get(f"{server.url}/health", timeout=0.5)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:  # accepted into a backlog nobody serves: it hangs
            pass
        return False

    scheduler = server.child_pid("scheduler_0")
    threads, outs, tokens = held_streams(server, scheduler)
    try:
        server.proc.send_signal(signal.SIGTERM)
        wait_for(refused, 60, "new connections to be refused", interval=0.05)
        assert any(t.is_alive() for t in threads)  # while the drain still runs
    finally:
        os.kill(scheduler, signal.SIGCONT)
    for t in threads:
        t.join(600)
    for out in outs:
        assert out[-1].get("usage", {}).get("completion_tokens") == tokens, out[-1]
    assert server.wait_exit(60) == 0


def held_streams(server: Server, scheduler: int) -> tuple[list[Any], list[Any], int]:
    """Streams on both API processes, the scheduler stopped (SIGSTOP; children ignore SIGTERM:
    the launcher drains them) while some still wait for tokens: on a quiet machine all 200
    tokens were out before the stop landed (seen), so then again with streams twice as long."""
    tokens = STREAM_TOKENS
    for _ in range(4):
        threads, outs = streams_on_both(server, 8, tokens)
        os.kill(scheduler, signal.SIGSTOP)
        time.sleep(0.5)  # the tokens generated before the stop reach their streams
        if any(t.is_alive() for t in threads):
            return threads, outs, tokens
        os.kill(scheduler, signal.SIGCONT)
        tokens *= 2
    raise AssertionError(f"every stream of up to {tokens // 2} tokens ended before the stop")


@pytest.mark.parametrize(
    "victim, sig",
    [
        ("scheduler_0", signal.SIGKILL),
        ("api_server_1", signal.SIGKILL),
        ("scheduler_0", signal.SIGSTOP),
    ],
)
def test_a_dead_or_hung_process_fails_every_api_process_s_streams(
    model_dir: str, tmp_path: Any, victim: str, sig: int
) -> None:
    """SIGKILL the scheduler under load: the streams of both API processes end with the error
    event. SIGKILL API process 1: its own connections are cut, rank 0's get the error event.
    SIGSTOP the scheduler: the watchdogs (--watchdog-timeout 3) fail both processes' streams.
    Each time the server exits 1 naming the reason."""
    log = str(tmp_path / "server.log")
    args = ("--page-size", "4", "--api-server-count", "2", "--watchdog-timeout", "3")
    server = Server(model_dir, *args, log_path=log)
    pid = None
    try:
        server.wait_ready()
        threads, outs = streams_on_both(server, 10, CONTEXT - 100)
        pid = server.child_pid(victim)
        os.kill(pid, sig)
        reason = f"{victim} process died" if sig == signal.SIGKILL else "watchdog: no progress"
        assert server.wait_exit(timeout=20) == 1
        assert f"minisgl: {reason}" in server.log()
        for t in threads:
            t.join(10)
        errors = [o[-1]["error"]["message"] for o in outs if "error" in o[-1]]
        assert all(reason in e for e in errors), errors
        cut = sum("cut" in o[-1] for o in outs)
        assert len(errors) + cut == len(outs) and (cut == 0 if victim == "scheduler_0" else errors)
        assert server.stop() == 1  # checks that no process survived
    finally:
        if pid is not None and sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if server.proc.poll() is None:
            server.kill_all()
