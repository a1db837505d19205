"""The request path's defences (issue 18): text that is not valid Unicode, per-request limits
checked before any work, no admission slot lost on any failure, unexpected exceptions as counted
JSON 500s, a long prompt tokenized off the worker's loop, internal messages that do not decode,
and an OpenAPI document that says what the server answers. The server tests run the real
processes on the tiny model; the others drive the parts directly."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import Server, make_tiny_model, run_server, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
MAX_QUEUED = 4
# a small request held this long waited behind a huge prompt (the old stall was ~8 s per one)
STALL_S = 4.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))
    log = str(tmp_path_factory.mktemp("logs") / "limits.log")
    args = ("--page-size", "4", "--max-queued-requests", str(MAX_QUEUED))
    with run_server(model, *args, log_path=log) as s:
        yield s


def post(server: Server, path: str, body: str | bytes | dict[str, Any]) -> httpx.Response:
    """POST raw JSON text (so that it can hold escapes a JSON encoder would not write)."""
    content = json.dumps(body) if isinstance(body, dict) else body
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def http_count(server: Server, path: str, status: int) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "minisgl_http_requests_total" and s.labels == {
                "path": path,
                "status": str(status),
            }:
                return s.value
    return 0.0


def assert_nothing_in_flight(server: Server) -> None:
    stats = server.wait_idle()
    assert stats["in_flight"] == 0 and stats["queued"] == 0, stats


# (path, body, the field the 400 must name): a lone surrogate (JSON's escape, where the body
# has ~) in every kind of string field
INVALID_TEXT = [
    ("/v1/completions", '{"prompt": "a~", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "~"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "a", "stop": "~"}', "stop"),
    ("/v1/completions", '{"prompt": "a", "stop": ["x", "~"]}', "stop[1]"),
    ("/v1/completions", '{"prompt": "a", "regex": "[a-z]~"}', "regex"),
    ("/v1/completions", '{"prompt": "a", "ebnf": "root ::= \\"~\\""}', "ebnf"),
    ("/v1/completions", '{"prompt": "a", "json_schema": "~"}', "json_schema"),
    ("/v1/completions", '{"prompt": "a", "model": "~"}', "model"),
    ("/v1/completions", '{"prompt": "a", "user": "x~y"}', "user"),
    ("/v1/completions", '{"prompt": "a", "x~": 1}', "x~"),  # a field's name, escaped
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "~"}]}',
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "~"}]}]}',
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "~", "content": "a"}]}', "messages[0].role"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"k": "~"}}',
        "chat_template_kwargs.k",
    ),
    ("/generate", '{"text": "~"}', "text"),
    ("/generate", '{"text": "a", "sampling_params": {"stop": ["~"]}}', "sampling_params.stop[0]"),
    ("/tokenize", '{"prompt": "~"}', "prompt"),
]


def test_invalid_text_in_every_field_is_a_400_and_takes_no_slot(server: Server) -> None:
    """Before the fix each of these got a plain-text 500 and kept its admission slot forever:
    four of them (--max-queued-requests 4) made every later request a 503."""
    before = http_count(server, "/v1/completions", 400)
    for i, (path, body, field) in enumerate(INVALID_TEXT):
        escape = ["\\ud800", "\\uDFFF", "\\ud83d"][i % 3]  # high, low, high before text
        body, field = body.replace("~", escape), field.replace("~", escape.lower())
        r = post(server, path, body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["code"] == "invalid_unicode", (body, error)
        assert f"{field}: text is not valid Unicode" in error["message"]
    completions = sum(path == "/v1/completions" for path, _, _ in INVALID_TEXT)
    assert http_count(server, "/v1/completions", 400) - before == completions
    assert_nothing_in_flight(server)
    # surrogate pairs (an emoji as an ASCII-only encoder writes it) are valid text
    r = post(server, "/v1/completions", '{"prompt": "\\ud83d\\ude00 \\\\ud800", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    for _ in range(2 * MAX_QUEUED):
        r = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert_nothing_in_flight(server)


def test_limits_before_any_work(server: Server) -> None:
    from minisgl.ext.serving.fields import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS
    from minisgl.ext.structured.fields import MAX_GRAMMAR_CHARS

    base = {"prompt": "hello", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}
    refused: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", base | {"stop": ["ab"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ("/v1/completions", base | {"stop": "a" * (MAX_STOP_CHARS + 1)}, "stop"),
        ("/v1/completions", base | {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "regex"),
        ("/v1/completions", base | {"ebnf": "a" * (MAX_GRAMMAR_CHARS + 1)}, "ebnf"),
        (
            "/v1/completions",
            base | {"json_schema": {"enum": ["a" * MAX_GRAMMAR_CHARS]}},
            "json_schema",
        ),
        ("/v1/chat/completions", chat, "messages"),
        ("/generate", {"text": "a", "sampling_params": {"stop": ["a"] * 1000}}, "stop"),
    ]
    for path, body, field in refused:
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and error["code"] == "limit_exceeded", error
    # at the limits: served
    at_limits = base | {"stop": ["xyz"] * MAX_STOP_STRINGS, "regex": "[a-z]{1,5}"}
    assert post(server, "/v1/completions", at_limits).status_code == 200
    chat["messages"] = chat["messages"][:MAX_MESSAGES]
    r = post(server, "/v1/chat/completions", chat | {"max_tokens": 1})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]  # the context's
    assert_nothing_in_flight(server)


def test_prompt_far_beyond_the_context_is_refused_before_tokenizing(server: Server) -> None:
    r = post(server, "/v1/completions", {"prompt": "hello " * 100_000, "max_tokens": 2})
    assert r.status_code == 400 and "600000 characters" in r.json()["error"]["message"], r.text
    chat = {"messages": [{"role": "user", "content": "hi " * 100_000}]}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert_nothing_in_flight(server)


def test_a_10_mb_prompt_does_not_hold_up_small_requests(server: Server) -> None:
    """Small requests sent while 10 MB prompts arrive all answer, none held up behind a huge
    one: each huge prompt is refused by its length in characters, never tokenized (before: it
    was tokenized whole first, ~8 s during which every request behind it waited). Each refused
    10 MB body still costs ~75 ms of JSON parsing on the API process's event loop; the bound is
    against the stall, far above what load costs (a 2x-of-alone bound failed on a busy machine)."""
    huge = json.dumps({"prompt": "hello world " * 870_000, "max_tokens": 2}).encode()
    assert len(huge) > 10_000_000
    small = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}

    def latencies(until: Any) -> list[float]:
        out: list[float] = []
        with httpx.Client(timeout=60) as client:
            while not until(out):
                start = time.perf_counter()
                r = client.post(f"{server.url}/v1/completions", json=small)
                out.append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
        return out

    latencies(lambda out: len(out) == 3)  # warm up
    refusals: list[tuple[int, str]] = []

    def send_huge() -> None:
        with httpx.Client(timeout=120) as client:
            for _ in range(6):
                headers = {"content-type": "application/json"}
                r = client.post(f"{server.url}/v1/completions", content=huge, headers=headers)
                refusals.append((r.status_code, r.json()["error"]["message"]))
                time.sleep(0.5)  # one at a time: a stall, not CPU contention, is what is measured

    sender = threading.Thread(target=send_huge)
    sender.start()
    try:
        loaded = latencies(lambda out: not sender.is_alive() and len(out) >= 15)
    finally:
        sender.join(300)
    assert [status for status, _ in refusals] == [400] * 6, refusals
    assert all("characters" in message for _, message in refusals), refusals
    assert max(loaded) < STALL_S, loaded
    assert_nothing_in_flight(server)


def test_bools_are_not_token_ids(server: Server) -> None:
    refused: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", {"prompt": [False, 5], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [[5, True]], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [True]}, "stop_token_ids"),
        ("/generate", {"input_ids": [5, False]}, "input_ids"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ]
    for path, body, field in refused:
        r = post(server, path, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"].startswith(field), r.json()
    assert post(server, "/v1/completions", {"prompt": [0, 5], "max_tokens": 2}).status_code == 200


def test_max_completion_tokens_zero_is_refused(server: Server) -> None:
    for extra in ({}, {"max_tokens": 3}):
        body = {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0}
        r = post(server, "/v1/chat/completions", body | extra)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_completion_tokens", r.text


def test_openapi_says_400_and_405_says_allow(server: Server) -> None:
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(doc)
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert "422" not in statuses and "500" in statuses, (path, method)
            if method == "post":
                assert {"400", "413"} <= statuses, (path, statuses)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "503", "504"} <= set(chat)
    r = post(server, "/v1/chat/completions", {"messages": "nope"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.put(f"{server.url}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    r = httpx.post(f"{server.url}/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET", r.headers


# ---- the parts, driven directly ------------------------------------------------------------
def test_unexpected_exception_is_a_counted_json_500() -> None:
    from fastapi import FastAPI

    from minisgl.ext.serving.http import ServingGate
    from minisgl.ext.serving.metrics import Metrics
    from minisgl.message import SchedulerStats
    from minisgl.server.args import ServerArgs

    app = FastAPI()

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    frontend: Any = SimpleNamespace(metrics=Metrics(SchedulerStats, lambda: 0), api_count=1)
    paths = frozenset({"/boom"})
    # as create_app does: inside Starlette's outermost error middleware
    args = ServerArgs()
    app.add_middleware(ServingGate, args=args, frontend=frontend, paths=paths)

    async def run() -> None:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.get("/boom")
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "internal_error"
            assert "RuntimeError" in r.json()["error"]["message"]
            assert "a bug" not in r.text  # details stay in the log

    asyncio.run(run())
    assert frontend.metrics.http.labels("/boom", "500")._value.get() == 1


def test_a_message_that_cannot_be_sent_takes_no_slot(tmp_path: Any) -> None:
    from minisgl.core import SamplingParams
    from minisgl.message import TokenizeMsg
    from minisgl.server.frontend import Frontend

    async def run() -> None:
        frontend = Frontend([f"ipc://{tmp_path}/tok"], f"ipc://{tmp_path}/api")
        msg = TokenizeMsg(1, "\ud800", None, None, SamplingParams())
        with pytest.raises(UnicodeEncodeError):
            await frontend.submit(msg, asyncio.Queue())
        assert frontend.requests == {} and frontend.num_queued == 0
        frontend.recv.close()
        for q in frontend.to_tokenizers:
            q.close()

    asyncio.run(run())


def test_a_request_past_its_timeout_ends_with_the_error_and_is_aborted(tmp_path: Any) -> None:
    """--request-timeout (the serving extension's Frontend): the request's last reply is the
    timeout error (504), the pipeline gets its abort, and a reply that comes later is dropped;
    one that ends in time leaves no timer behind."""
    from contextlib import aclosing

    from minisgl.core import SamplingParams
    from minisgl.ext.serving.frontend import ServingFrontend
    from minisgl.message import AbortMsg, BatchMsg, TokenizeMsg, UserReply
    from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue

    tok_addr, api_addr = f"ipc://{tmp_path}/tok", f"ipc://{tmp_path}/api"

    async def run() -> None:
        tok = ZmqAsyncPullQueue(tok_addr, create=True)
        frontend = ServingFrontend([tok_addr], api_addr, request_timeout=0.2)
        frontend.start()
        msg = TokenizeMsg(frontend.new_uid(), "hi", None, None, SamplingParams())
        async with aclosing(frontend.batches([msg])) as batches:
            ((_, reply),) = await asyncio.wait_for(batches.__anext__(), 10)
            assert (reply.finished, reply.finish_reason) == (True, "timeout")
            assert reply.error == "request timed out after 0.2 s"
        assert frontend.metrics.finished.labels("timeout")._value.get() == 1  # counted
        assert isinstance(await tok.get(), TokenizeMsg)
        assert await asyncio.wait_for(tok.get(), 10) == AbortMsg(msg.uid)
        assert frontend.requests == {} and frontend.num_queued == 0
        api = ZmqAsyncPushQueue(api_addr, create=False)
        await api.put(BatchMsg([UserReply(msg.uid, "late", [1], True, "stop", 1, 1)]))
        ok = TokenizeMsg(frontend.new_uid(), "hi", None, None, SamplingParams())
        async with aclosing(frontend.batches([ok])) as batches:
            await api.put(BatchMsg([UserReply(ok.uid, "a", [1], True, "stop", 1, 1)]))
            ((_, reply),) = await asyncio.wait_for(batches.__anext__(), 10)
            assert reply.uid == ok.uid and reply.finish_reason == "stop"  # not the late one
        assert frontend.requests == {} and frontend._timers == {}
        for q in (tok, api, frontend.recv, *frontend.to_tokenizers):
            q.close()

    asyncio.run(run())


def test_internal_messages_that_do_not_decode_are_dropped(tmp_path: Any) -> None:
    import msgpack

    from minisgl.message import AbortMsg
    from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqPullQueue, ZmqPushQueue

    garbage = [
        b"\xc1",  # not msgpack
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["NoSuchMessage", 1]))),
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(["AbortMsg", 1, 2, 3]))),  # wrong fields
    ]
    addr = f"ipc://{tmp_path}/sync"
    pull, push = ZmqPullQueue(addr, create=True), ZmqPushQueue(addr, create=False)
    for data in garbage:
        push.socket.send(data)
    push.put(AbortMsg(7))
    assert pull.get(timeout=10) == AbortMsg(7)
    for data in garbage:
        push.socket.send(data)
    assert pull.get(timeout=0.2) is None
    push.put(AbortMsg(8))
    assert wait_for(pull.get_nowait, 10, "a message") == AbortMsg(8)

    async def run() -> Any:
        apull = ZmqAsyncPullQueue(f"ipc://{tmp_path}/async", create=True)
        apush = ZmqPushQueue(f"ipc://{tmp_path}/async", create=False)
        for data in garbage:
            apush.socket.send(data)
        apush.put(AbortMsg(9))
        try:
            return await asyncio.wait_for(apull.get(), 10)
        finally:
            apull.close()
            apush.close()

    assert asyncio.run(run()) == AbortMsg(9)
    for q in (pull, push):
        q.close()


class SentList:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def put(self, msg: Any) -> None:
        self.sent.append(msg)


class GatedTokenizer:
    """Tokenizes a long text only once `release` is set (a slow tokenizer, without a clock)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abcd": 1}

    def encode(self, text: str) -> list[int]:
        if len(text) > 100:
            assert self.release.wait(30)
        return [0] * 3


def test_long_prompt_is_tokenized_off_the_loop() -> None:
    from minisgl.core import SamplingParams
    from minisgl.ext.serving.worker import BACKGROUND_CHARS, ServingTokenizerWorker
    from minisgl.message import AbortMsg, TokenizeMsg, UserMsg

    tokenizer = GatedTokenizer()
    sched, detok, api = SentList(), SentList(), SentList()
    worker = ServingTokenizerWorker(tokenizer, [sched], detok, api)
    long = "a" * (BACKGROUND_CHARS + 1)

    def msg(uid: int, text: str) -> TokenizeMsg:
        return TokenizeMsg(uid, text, None, None, SamplingParams(), max_seq_len=10**6)

    worker.handle(msg(1, long))
    worker.handle(msg(2, long))
    worker.handle(AbortMsg(2))  # its client left while it was being tokenized
    worker.handle(msg(3, "short"))
    worker.handle(AbortMsg(3))
    assert [type(m).__name__ for m in sched.sent] == ["UserMsg", "AbortBackendMsg"]
    assert sched.sent[0].uid == 3 and set(worker.pending) == {1, 2}
    tokenizer.release.set()
    wait_for(lambda: all(f.done() for _, f in worker.pending.values()), 30, "tokenization")
    worker.forward_done()
    assert [m.uid for m in sched.sent if isinstance(m, UserMsg)] == [3, 1]  # 2 was dropped
    assert [m.uid for m in detok.sent] == [3, 1] and not api.sent and not worker.pending
    # a prompt too long for any context of its tokens is refused before tokenizing
    worker.handle(TokenizeMsg(4, "a" * 81, None, None, SamplingParams(), max_seq_len=10))
    assert api.sent[0].msgs[0].uid == 4 and "81 characters" in api.sent[0].msgs[0].error
    worker.background.shutdown()


def test_the_size_bound_never_refuses_a_prompt_that_fits() -> None:
    """A prompt of max_seq_len tokens, each the longest in the vocabulary, passes the check."""
    from minisgl.ext.serving.worker import check_prompt_size, max_token_chars
    from support.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    longest = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([longest])
    context = 512
    prompt = text * context
    assert len(tokenizer.encode(prompt)) <= context
    check_prompt_size(tokenizer, len(prompt), context)
    with pytest.raises(ValueError, match="too long"):
        check_prompt_size(tokenizer, 2 * max_token_chars(tokenizer) * context + 1, context)


def test_grammar_compile_deadline_counts_from_arrival() -> None:
    from minisgl.ext.structured.grammar import TIMED_OUT, Constraint, GrammarError

    constraint = Constraint(Future())  # a compile that never ends
    assert constraint.failure() is None
    constraint.deadline = time.monotonic() - 1
    assert constraint.failure() == TIMED_OUT  # refused before admission, no step waits
    with pytest.raises(GrammarError, match="longer than"):
        constraint.wait()
