"""Two minisgl servers behind sglang-router (`cache_aware`, issue 21): the official `openai`
client streams chat and completions through the router, and requests that share a long prefix
land on one worker (each server's prefix-cache metrics say where they ran). The router itself
calls /health, /model_info and /server_info on each worker, and sends /generate with SGLang's
extra fields. Skipped without the `router` extra (`pip install minisgl[router]`)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import Server, free_port, make_tiny_model, run_servers, wait_for

pytest.importorskip("sglang_router", reason="the router extra: pip install minisgl[router]")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    model = make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))
    logs = tmp_path_factory.mktemp("logs")
    args = ["--page-size", "4", "--served-model-name", "tiny"]
    started = [Server(model, *args, log_path=str(logs / f"w{i}.log")) for i in range(2)]
    with run_servers(*started):  # both start at once
        yield started


@pytest.fixture(scope="module")
def router(workers: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--prometheus-port", str(free_port())]
    cmd += ["--policy", "cache_aware", "--worker-urls", *(w.url for w in workers)]
    log_path = tmp_path_factory.mktemp("logs") / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(log_path.parent))
    try:

        def serving() -> bool:
            assert proc.poll() is None, f"router exited:\n{log_path.read_text()}"
            body = {"model": "tiny", "prompt": "warm up", "max_tokens": 1}
            try:
                return httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(serving, 60, "the router to reach its workers")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_openai_client_streams_through_the_router(router: str) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none")
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    chunks = list(chat)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    stream = client.completions.create(
        model="tiny", prompt="once upon", max_tokens=6, temperature=0, stream=True
    )
    parts = list(stream)
    assert parts[-1].choices[0].finish_reason == "length"
    assert "".join(p.choices[0].text for p in parts)
    native = httpx.post(
        f"{router}/generate",
        json={"text": "once upon", "sampling_params": {"max_new_tokens": 3}},
        timeout=30,
    )
    assert native.status_code == 200 and len(native.json()["output_ids"]) == 3


def counters(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    names = ("minisgl_prefill_tokens_total", "minisgl_prefix_cache_hit_tokens_total")
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in names
    }


def test_shared_prefix_lands_on_one_worker(router: str, workers: list[Server]) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none")
    prefix = "You are a careful assistant. " * 20  # a long system prompt, shared by all
    for w in workers:
        w.wait_idle()
    before = [counters(w) for w in workers]
    for i in range(6):
        client.completions.create(model="tiny", prompt=f"{prefix} question {i}", max_tokens=2)
    for w in workers:
        w.wait_idle()
    after = [counters(w) for w in workers]
    prefill = [
        a["minisgl_prefill_tokens_total"] - b["minisgl_prefill_tokens_total"]
        for a, b in zip(after, before)
    ]
    hits = [
        a["minisgl_prefix_cache_hit_tokens_total"] - b["minisgl_prefix_cache_hit_tokens_total"]
        for a, b in zip(after, before)
    ]
    busy = max(range(2), key=lambda i: prefill[i])
    assert prefill[1 - busy] == 0, (prefill, hits)  # every request ran on one worker
    assert hits[busy] >= 5 * 100, (prefill, hits)  # the 5 after the first reused the prefix
