"""Data-parallel replicas (issue 21): `--dp 2` on CPU (two scheduler processes behind one API
server and tokenizer) gives the greedy tokens of one engine; with a shared-prefix workload the
prefix-aware dispatcher gets at least 1.8x the prefix-cache hits of round robin; killing one
replica fails the requests in flight and stops the server (exit 1 within 5 s, nothing left)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minisgl import LLM, SamplingParams
from support.server import Server, make_tiny_model, run_servers, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
PAGE = 4
POOL_PAGES = 200  # per replica: 4 of the 8 prefixes below fit with room to work, 8 do not
PREFIXES, PER_PREFIX, PREFIX_LEN = 8, 16, 128
LONG = 600  # tokens of a request that runs for a while
ENGINE = ["--page-size", str(PAGE), "--num-pages", str(POOL_PAGES)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="module")
def dp_servers(model_dir: str, tmp_path_factory: Any) -> Iterator[dict[str, Server]]:
    """A server of each dispatch policy, both started at once (the module uses both)."""
    logs = tmp_path_factory.mktemp("logs")
    started = {}
    for dispatch in ("prefix", "round_robin"):
        args = ["--dp", "2", "--dp-dispatch", dispatch, *ENGINE]
        started[dispatch] = Server(model_dir, *args, log_path=str(logs / f"dp-{dispatch}.log"))
    with run_servers(*started.values()):
        yield started


@pytest.fixture(scope="module")
def prefix_server(dp_servers: dict[str, Server]) -> Server:
    return dp_servers["prefix"]


@pytest.fixture(scope="module")
def rr_server(dp_servers: dict[str, Server]) -> Server:
    """Its last test kills one of its replicas."""
    return dp_servers["round_robin"]


def generate(url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    params = {"max_new_tokens": max_tokens, "ignore_eos": True}
    body = json.dumps({"input_ids": ids, "sampling_params": params}).encode()
    request = urllib.request.Request(f"{url}/generate", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def metric(server: Server, name: str) -> dict[str, float]:
    """`name`'s samples by dp_rank label ("" when it has none)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.labels.get("dp_rank", ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_dp2_greedy_equals_one_engine(prefix_server: Server, model_dir: str) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 20))] for _ in range(8)]
    outs: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        outs[i] = generate(prefix_server.url, prompts[i], 8)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    llm = LLM(model_dir, page_size=PAGE, num_pages=POOL_PAGES)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert outs == expected
    served = metric(prefix_server, "minisgl_replica_prefill_tokens_total")
    assert served["0"] > 0 and served["1"] > 0  # both replicas took part
    assert sum(served.values()) == metric(prefix_server, "minisgl_prefill_tokens_total")[""]


def test_data_parallel_rank_and_health_generate(prefix_server: Server) -> None:
    """SGLang's data_parallel_rank picks the replica; /health_generate runs on each."""
    url = prefix_server.url
    for replica in (1, 0):
        before = metric(prefix_server, "minisgl_replica_prefill_tokens_total")
        body = {"input_ids": [9, 8, 7], "data_parallel_rank": replica}
        assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 200
        prefix_server.wait_idle()
        after = metric(prefix_server, "minisgl_replica_prefill_tokens_total")
        assert after[str(replica)] - before[str(replica)] == 3
        assert after[str(1 - replica)] == before[str(1 - replica)]
    bad = httpx.post(f"{url}/generate", json={"text": "x", "data_parallel_rank": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "data_parallel_rank"
    before = metric(prefix_server, "minisgl_replica_prefill_tokens_total")
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    prefix_server.wait_idle()
    after = metric(prefix_server, "minisgl_replica_prefill_tokens_total")
    assert all(after[r] - before[r] == 1 for r in ("0", "1"))  # token id 0 on each replica
    loads = httpx.get(f"{url}/get_load", timeout=10).json()
    assert [x["dp_rank"] for x in loads] == [0, 1] and all(x["num_reqs"] == 0 for x in loads)


def shared_prefix_hits(server: Server) -> float:
    """8 prefixes x 16 requests, one at a time, each round in a rotated order (round robin
    then sends every prefix to both replicas, which cannot hold all 8): the prefix-cache hit
    tokens they add."""
    assert httpx.post(f"{server.url}/flush_cache", timeout=10).status_code == 200
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 400) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    before = metric(server, "minisgl_prefix_cache_hit_tokens_total")[""]
    for j in range(PER_PREFIX):
        for k in range(PREFIXES):
            p = (k + j) % PREFIXES
            generate(server.url, prefixes[p] + [rng.randrange(3, 400) for _ in range(PAGE)], 1)
    server.wait_idle()
    return metric(server, "minisgl_prefix_cache_hit_tokens_total")[""] - before


def test_prefix_dispatch_beats_round_robin(prefix_server: Server, rr_server: Server) -> None:
    aware, blind = shared_prefix_hits(prefix_server), shared_prefix_hits(rr_server)
    print(f"prefix-cache hit tokens: prefix {aware:.0f}, round robin {blind:.0f}")
    assert aware >= 1.8 * blind and aware > 0


def test_flush_cache_refused_while_requests_run(rr_server: Server) -> None:
    """A flush while a request runs is refused. A fast CPU can end the request (LONG tokens
    in ~0.3 s) between the poll that saw it running and the flush: then it is tried again with
    a new one; a server that never refuses fails every attempt."""

    def run(done: threading.Event) -> None:
        generate(rr_server.url, [5, 6, 7], LONG)
        done.set()

    refusals = []
    for _ in range(8):
        done = threading.Event()
        thread = threading.Thread(target=run, args=(done,), daemon=True)
        thread.start()
        wait_for(lambda: rr_server.stats()["running"] > 0, 30, "the request to run", 0.01)
        r = httpx.get(f"{rr_server.url}/flush_cache", timeout=10)
        thread.join(60)
        assert done.is_set()
        if r.status_code != 200:
            refusals.append(r)
            break
    assert refusals, "every flush succeeded while a request was running"
    assert refusals[0].status_code == 400 and refusals[0].json()["error"]["code"] == "cache_busy"
    rr_server.wait_idle()
    assert httpx.post(f"{rr_server.url}/flush_cache", timeout=10).status_code == 200
    assert rr_server.stats()["cached_pages"] == 0


def test_dead_replica_fails_requests_and_stops_the_server(rr_server: Server) -> None:
    """rr_server's last test: SIGKILL replica 1 under load."""
    errors: list[str] = []

    def client() -> None:
        try:
            generate(rr_server.url, [5, 6, 7], LONG)
            errors.append("finished")
        except OSError as e:  # urllib's HTTPError: the 503
            errors.append(e.read().decode() if hasattr(e, "read") else repr(e))

    # Replica 1 is stopped (SIGSTOP) before the load: its two requests (round robin) then stay
    # in flight however fast this machine is (a fast CPU ended all four before a poll saw them).
    victim = rr_server.child_pid("dp1_scheduler_0")
    os.kill(victim, signal.SIGSTOP)
    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    seen: list[int] = []  # what the polls saw, for the failure message

    def submitted() -> bool:  # all 4 arrived: in flight, or finished on replica 0
        seen.append(rr_server.stats()["in_flight"])
        return seen[-1] >= 2 and seen[-1] + len(errors) == 4

    try:
        wait_for(submitted, 30, "the 4 requests to arrive", interval=0.01)
    except AssertionError as e:
        raise AssertionError(
            f"{e}; in_flight seen {sorted(set(seen))}, clients: {errors}"
        ) from None
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert rr_server.wait_exit(timeout=10) == 1
    assert time.monotonic() - killed < 5
    assert "minisgl: dp1_scheduler_0 process died (exit code -9)" in rr_server.log()
    for t in threads:
        t.join(5)
    # replica 1's two fail; replica 0's fail too unless they finished in the moment between
    # the kill and the server's failure (a fast machine can finish them there)
    failed = [e for e in errors if "dp1_scheduler_0 process died" in e]
    assert len(errors) == 4 and len(failed) >= 2, errors
    assert all(e in failed or e == "finished" for e in errors), errors
    rr_server.expect_code = 1  # run_servers' stop then checks that no process survived
