"""A streamed response's handler that fell behind writes every reply that has come in one write
(issue 22: at GPU rates the API process would otherwise spend a send per token per stream and
fall further behind), with the same events as one write per reply; and `bench_api.py`, which
measures the API process alone, runs (ext/perf's one-format chunk: tests/unit/test_perf_chunks.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

from minisgl.message import BatchMsg, TokenizeMsg, UserReply
from minisgl.server.api_server import create_app
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend
from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue
from support.server import REPO

LATER = 5  # replies that reach the handler together, after each choice's first

try:  # the server's: the serving extension's Gate counts responses in its Frontend's metrics
    from minisgl.ext.serving.frontend import ServingFrontend as front_end
except ModuleNotFoundError:  # the core alone
    front_end = Frontend


async def fake_pipeline(
    tok: ZmqAsyncPullQueue, api: ZmqAsyncPushQueue, n: int, writes: list[bytes]
) -> None:
    """Answers the n choices of one request: a first reply each; once they are written, LATER
    replies each in one message (as the detokenizer's batches of several steps that came while
    the handler was busy), which the dispatcher queues before any handler runs."""
    msgs = []
    for _ in range(n):  # the server waits for a choice's first reply before starting the next
        msgs.append(m := await tok.get())
        assert isinstance(m, TokenizeMsg)
        await api.put(BatchMsg([UserReply(m.uid, "a", [1], False, None, 3, 1)]))
    while not writes:
        await asyncio.sleep(0.01)
    later = [
        UserReply(m.uid, f"{k}", [k], k == LATER, "length" if k == LATER else None, 3, 1 + k)
        for k in range(1, LATER + 1)
        for m in msgs
    ]
    await api.put(BatchMsg(later))


@pytest.mark.parametrize("n", [1, 2])
def test_replies_that_came_together_are_written_together(tmp_path: Any, n: int) -> None:
    tok_addr, api_addr = f"ipc://{tmp_path}/tok", f"ipc://{tmp_path}/api"
    writes: list[bytes] = []

    async def run() -> str:
        tok = ZmqAsyncPullQueue(tok_addr, create=True)
        frontend = front_end([tok_addr], api_addr)
        api = ZmqAsyncPushQueue(api_addr, create=False)
        app = create_app(frontend, ServerArgs(), {"max_seq_len": 1 << 16})

        async def counting(scope: Any, receive: Any, send: Any) -> None:
            async def counted(message: Any) -> None:
                if message["type"] == "http.response.body" and message.get("body"):
                    writes.append(message["body"])
                await send(message)

            await app(scope, receive, counted)

        frontend.start()  # the app's startup hook: ASGITransport runs no lifespan
        pipeline = asyncio.create_task(fake_pipeline(tok, api, n, writes))
        body = {"prompt": [5, 6, 7], "max_tokens": 16, "stream": True, "n": n, "seed": 1}
        transport = httpx.ASGITransport(counting)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/v1/completions", json=body)
        await pipeline
        for q in (tok, api, frontend.recv, *frontend.to_tokenizers):
            q.close()
        assert r.status_code == 200, r.text
        return r.text

    text = asyncio.run(run())
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {
        i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
        for i in range(n)
    }
    assert texts == {i: "a12345" for i in range(n)}
    finished = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finished.count("length") == n and len(chunks) == n * (1 + LATER)
    # the first replies, the LATER x n replies, then [DONE]: one write each
    assert len(writes) == 3, [w[:60] for w in writes]
    assert [w.count(b"data: ") for w in writes] == [n, LATER * n, 1]


def test_bench_api_runs() -> None:
    cmd = [sys.executable, os.path.join(REPO, "benchmark", "online", "bench_api.py")]
    cmd += ["--streams", "4", "--tokens", "8", "--step-ms", "2", "--port", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 streams x 8 tokens" in out.stdout and "delivered" in out.stdout, out.stdout


def test_a_dead_pipeline_refuses_new_requests(tmp_path: Any) -> None:
    """Once the pipeline is gone (`Frontend.fail`), a new request is a 503 naming why."""
    from minisgl.server.protocol import APIError

    frontend = Frontend([f"ipc://{tmp_path}/tok"], f"ipc://{tmp_path}/api")
    frontend.admit()  # alive: admitted
    frontend.fail("scheduler_0 process died (exit code 1)")
    with pytest.raises(APIError) as refused:
        frontend.admit()
    assert (refused.value.status, refused.value.code) == (503, "server_unavailable")
    assert (
        refused.value.message == "server is shutting down: scheduler_0 process died (exit code 1)"
    )
    for q in (frontend.recv, *frontend.to_tokenizers):
        q.close()
