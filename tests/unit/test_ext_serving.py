"""The serving extension (`minisgl/ext/serving`: SGLang's routes, Prometheus metrics) and the
core without it (issue 46): the extension fills its points; with MINISGL_DISABLE_EXTENSIONS=1 a
real server answers SGLang's endpoints and /metrics 404 as it does any unknown route, refuses
every undeclared /generate field with a 400 naming it, counts nothing, and still serves /stats
and /generate (its /v1/models without vocab_size); `--dp 2`, `LLM(dp=2)`, --api-key,
MINISGL_API_KEY and --exit-with-parent are refused as needing the extension. The core-alone
tests carry the `core` mark (.ci/run runs them without ext/)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from minisgl import LLM, extension
from minisgl.message import UserReply
from minisgl.server.frontend import Frontend, _InFlight
from minisgl.utils.options import OptionError
from support.server import Server, make_tiny_model, run_server

SGLANG_ONLY = [
    ("GET", "/metrics"),
    ("GET", "/model_info"),
    ("GET", "/get_model_info"),
    ("GET", "/server_info"),
    ("GET", "/get_server_info"),
    ("GET", "/get_load"),
    ("POST", "/flush_cache"),
    ("GET", "/health_generate"),
]


@pytest.fixture(scope="module")
def core_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    log = str(tmp_path_factory.mktemp("logs") / "core.log")
    env = {"MINISGL_DISABLE_EXTENSIONS": "1"}
    with run_server(model, "--page-size", "4", extra_env=env, log_path=log) as s:
        yield s


def resolved(value: Any) -> Any:
    """A point's value; one registered by name (`Lazy`: the API process's parts) imported."""
    from minisgl.ext.lazy import Lazy

    return value.resolve() if isinstance(value, Lazy) else value


def test_the_extension_fills_its_points() -> None:
    from minisgl.ext.serving import fields, metrics, sglang

    points = extension.extensions()
    routes = [resolved(add) for add in points.routes]
    assert sglang.add_sglang_routes in routes
    assert metrics.add_metrics_route in routes
    assert isinstance(points.unknown_fields, fields.UnknownFields)  # SGLang's on /generate
    from minisgl.ext.serving import llm_dp, replicas, scale, worker

    assert resolved(points.replicas) is replicas.replicated_llm
    assert points.replicas() is llm_dp.ReplicatedLLM
    # its tokenizer workers pick the --dp replica
    assert resolved(points.launcher) is scale.ServingLauncher
    made = worker.tokenizer_worker(16, "prefix", 8)([], [1, 2], None, [])  # two replicas
    assert isinstance(made, worker.ServingTokenizerWorker) and made.dispatcher is not None
    made.background.shutdown()
    from minisgl.ext.serving import disconnect, http, options, status

    assert points.options["serving"] is options.ServingOptions
    assert points.gate is http.ServingGate and points.http_server is http.serving_http_server
    assert status.add_status_routes in routes
    assert disconnect.add_disconnect_routes in routes  # a plain response's client leaving


MOVED_FLAGS = [  # the serving extension's: its `options` point declares them (flag, value, parsed)
    ("--max-connections", "8", 8),
    ("--timeout-keep-alive", "2", 2.0),
    ("--timeout-body-read", "2", 2.0),
    ("--health-check-timeout", "2", 2.0),
    ("--api-server-count", "2", 2),
    ("--nnodes", "1", 1),
    ("--node-rank", "0", 0),
    ("--dist-init-addr", "h:1", "h:1"),
    ("--dist-timeout", "5", 5.0),
    ("--gc-threshold", "7", [7]),
    ("--gc-warning-threshold-secs", "1", 1.0),
]
# the request limits, the API key and the chat template, once the core's: without it refused
# naming it (EXTENSION_OPTIONS)
LIMIT_FLAGS = [
    ("--max-queued-requests", "4", 4),
    ("--request-timeout", "2.5", 2.5),
    ("--max-request-bytes", "1000", 1000),
    ("--api-key", "sk-1", "sk-1"),
    ("--chat-template", "{{ 1 }}", "{{ 1 }}"),
]


@pytest.mark.parametrize(("flag", "value", "parsed"), MOVED_FLAGS + LIMIT_FLAGS)
def test_its_flags_reach_it_through_the_parsed_args(flag: str, value: str, parsed: Any) -> None:
    from minisgl.ext.serving.options import ServingOptions, serving_options
    from minisgl.server.args import parse_args

    name = flag[2:].replace("-", "_")
    assert getattr(serving_options(parse_args([flag, value])), name) == parsed
    assert getattr(ServingOptions(), name) != parsed or flag in ("--nnodes", "--node-rank")


@pytest.mark.core
@pytest.mark.parametrize(("flag", "value", "parsed"), MOVED_FLAGS + LIMIT_FLAGS)
def test_its_flags_are_unknown_without_it(
    core_alone: None, flag: str, value: str, parsed: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused, exit 2: the request limits naming the extension (the core knows their names),
    the others as unknown flags."""
    from minisgl.server.args import build_parser, parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    if (flag, value, parsed) in LIMIT_FLAGS:
        assert f"error: {flag} {NEEDS_SERVING} (minisgl/ext/serving)" in err, err
    else:
        assert f"unrecognized arguments: {flag} {value}" in err and "minisgl/ext" in err, err
    entries = [
        line.split()[0]
        for line in build_parser().format_help().splitlines()
        if line.startswith("  --")
    ]
    assert entries and flag not in entries  # --help has no entry for it


@pytest.mark.core
def test_an_api_key_in_the_environment_is_refused_without_it(
    core_alone: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MINISGL_API_KEY without the extension that checks it: no server open to all (exit 2,
    one line naming the variable and the extension); empty, it is no key."""
    from minisgl.server.args import parse_args

    monkeypatch.setenv("MINISGL_API_KEY", "sk-1")
    with pytest.raises(SystemExit) as exc:
        parse_args([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: MINISGL_API_KEY {NEEDS_SERVING} (minisgl/ext/serving)\n"), err
    assert err.count("\n") == 1, err
    monkeypatch.setenv("MINISGL_API_KEY", "")
    assert parse_args([]).tp == 1


@pytest.mark.core
def test_the_core_alone_counts_nothing(core_alone: None, tmp_path: Any) -> None:
    """The core's Frontend keeps no metrics (the serving extension's Frontend counts them) and
    observes a reply all the same."""
    addr = f"ipc://{tmp_path}/api"
    frontend = Frontend([f"ipc://{tmp_path}/tok"], addr)
    assert not hasattr(frontend, "metrics")
    req = _InFlight(asyncio.Queue())
    frontend._observe(req, UserReply(0, "x", [1], True, "stop", 1, 1), 1.0)
    assert req.last_token == 1.0
    frontend.recv.close()
    for q in frontend.to_tokenizers:
        q.close()


def test_the_serving_frontend_records_what_its_metrics_and_timeout_read(tmp_path: Any) -> None:
    """Its requests' records (`_in_flight`): the priority and submission time (the metrics'
    label and latencies), whether the last reply came (--request-timeout, the watchdog)."""
    from minisgl.core import SamplingParams
    from minisgl.ext.serving.frontend import ServingFrontend
    from minisgl.message import TokenizeMsg

    frontend = ServingFrontend([f"ipc://{tmp_path}/tok"], f"ipc://{tmp_path}/api")
    msg = TokenizeMsg(0, "hi", None, None, SamplingParams(priority=3))
    req = frontend.requests[0] = frontend._in_flight(msg, asyncio.Queue())
    assert (req.priority, req.finished, frontend.num_unfinished) == (3, False, 1)
    frontend._observe(req, UserReply(0, "x", [1], False, None, 1, 1), req.submitted + 0.5)
    assert (req.last_token, req.finished) == (req.submitted + 0.5, False)
    assert frontend.metrics.ttft.labels("3")._sum.get() == pytest.approx(0.5)  # from submission
    frontend._observe(req, UserReply(0, "", [], True, "stop", 1, 1), req.submitted + 1)
    assert req.finished and frontend.num_unfinished == 0
    for q in (frontend.recv, *frontend.to_tokenizers):
        q.close()


@pytest.mark.core
@pytest.mark.parametrize(("method", "path"), SGLANG_ONLY)
def test_sglang_routes_and_metrics_are_unknown_without_it(
    core_server: Server, method: str, path: str
) -> None:
    r = httpx.request(method, f"{core_server.url}{path}", timeout=30)
    unknown = httpx.request(method, f"{core_server.url}/no_such_route", timeout=30)
    assert r.status_code == 404 == unknown.status_code, r.text
    assert r.json() == unknown.json(), r.text  # as any unknown route: nothing says it exists


@pytest.mark.core
def test_generate_refuses_sglang_fields_without_it(core_server: Server) -> None:
    """SGLang's fields at their defaults pass only with the extension; alone, each is a 400."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    ok = httpx.post(f"{core_server.url}/generate", json=body, timeout=60)
    assert ok.status_code == 200, ok.text
    r = httpx.post(f"{core_server.url}/generate", json=body | {"log_metrics": True}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "log_metrics" and error["code"] == "unknown_field", error


@pytest.mark.core
def test_stats_stay_in_the_core(core_server: Server) -> None:
    r = httpx.get(f"{core_server.url}/stats", timeout=30)
    assert r.status_code == 200, r.text
    assert "in_flight" in r.json()
    paths = httpx.get(f"{core_server.url}/openapi.json", timeout=30).json()["paths"]
    assert "/stats" in paths and "/metrics" not in paths and "/flush_cache" not in paths


NEEDS_SERVING = "needs the serving extension"


@pytest.mark.core
def test_health_generate_is_refused_without_it(core_server: Server) -> None:
    assert httpx.get(f"{core_server.url}/health", timeout=30).json() == {"status": "ok"}
    r = httpx.get(f"{core_server.url}/health?generate=1", timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "generate" and NEEDS_SERVING in error["message"], error


@pytest.mark.core
@pytest.mark.parametrize("stream", [False, True])
def test_a_plain_server_serves_chat_without_it(core_server: Server, stream: bool) -> None:
    """Without the gate and uvicorn of the serving extension: chat, streamed or not, and a
    bad request's 400 naming the field."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(
        f"{core_server.url}/v1/chat/completions", json=body | {"stream": stream}, timeout=60
    )
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    bad = httpx.post(f"{core_server.url}/v1/chat/completions", json=body | {"top_p": 2}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p", bad.text


@pytest.mark.core
def test_dp_is_refused_on_the_command_line_without_it(tmp_path: Any) -> None:
    python = str(Path(__file__).resolve().parents[2] / "python")
    env = dict(os.environ, MINISGL_DISABLE_EXTENSIONS="1", PYTHONPATH=python)
    argv = [sys.executable, "-m", "minisgl", "--model", str(tmp_path), "--dp", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    # the flag is the extension's (its `options`): without it, refused naming the extension
    assert line == f"python -m minisgl: error: --dp {NEEDS_SERVING} (minisgl/ext/serving)", line


@pytest.mark.core
def test_llm_dp_is_refused_without_it(core_alone: None, tmp_path: Any) -> None:
    with pytest.raises(OptionError, match=NEEDS_SERVING) as refused:
        LLM(str(tmp_path), dp=2, device="cpu")
    assert refused.value.name == "dp" and isinstance(refused.value, ValueError)
    assert extension.extensions().replicas is None


# ---- --exit-with-parent, /v1/models' vocab_size, /flush_cache's messages --------------------
def test_exit_with_parent_is_its_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsed into its options; `ServingLauncher.start` starts the watch before anything else
    (in the main process, before the model loads, inside `launch_server`'s stop)."""
    from minisgl.ext.serving import scale
    from minisgl.ext.serving.options import serving_options
    from minisgl.server.args import ServerArgs, parse_args

    assert serving_options(parse_args(["--exit-with-parent"])).exit_with_parent is True
    assert serving_options(parse_args([])).exit_with_parent is False
    assert not hasattr(ServerArgs(), "exit_with_parent")  # not the core's

    class Started(Exception):
        pass

    def watch() -> None:
        raise Started  # the rest of `start` (listening, loading the model) must not run first

    monkeypatch.setattr(scale, "exit_with_parent", watch)
    launcher = scale.ServingLauncher.__new__(scale.ServingLauncher)
    launcher.options = serving_options(parse_args(["--exit-with-parent"]))
    with pytest.raises(Started):
        launcher.start()


@pytest.mark.core
@pytest.mark.parametrize("flag", ["--exit-with-parent", "--skip-server-warmup"])
def test_its_switches_are_refused_without_it(
    core_alone: None, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Value-less flags (--skip-server-warmup: the warm-up is the extension's) exit 2 naming it."""
    from minisgl.server.args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([flag])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {flag} {NEEDS_SERVING} (minisgl/ext/serving)\n"), err


@pytest.mark.core
def test_models_has_no_vocab_size_without_it(core_server: Server) -> None:
    card = httpx.get(f"{core_server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] > 0 and "vocab_size" not in card, card


def test_model_cards_add_the_vocab_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every card (an adapter's too) gets the tokenizer's size; a model without a tokenizer
    gets the core's cards."""
    import asyncio

    from minisgl.ext.serving import model_card
    from minisgl.ext.serving.model_card import model_cards
    from minisgl.server.protocol import APIError

    plain: list[dict[str, Any]] = [{"id": "base"}, {"id": "lora", "parent": "base"}]

    class Api:
        def __init__(self, tokenizer: Any) -> None:
            self.tokenizer = tokenizer

        async def models(self) -> dict[str, Any]:
            return {"object": "list", "data": [dict(card) for card in plain]}

        async def with_tokenizer(self, work: Any, param: str) -> Any:
            try:
                return work(self.tokenizer)
            except ValueError as e:
                raise APIError(400, str(e), param) from None

    monkeypatch.setattr(model_card, "with_tokenizer", lambda api, *work: api.with_tokenizer(*work))
    cards = asyncio.run(model_cards(Api(list(range(300)))))["data"]
    assert cards == [card | {"vocab_size": 300} for card in plain]
    assert asyncio.run(model_cards(Api(None)))["data"] == plain


def test_flush_cache_reaches_the_scheduler_process_through_its_point() -> None:
    """The scheduler process hands ext/serving's request to its handler, which flushes and
    sends the stats before the answer on the same ordered path (a /stats read after the answer
    shows the emptied cache)."""
    from minisgl.ext.serving.flush import FlushCacheReply, FlushCacheRequest, handle_flush
    from minisgl.message import BatchMsg, SchedulerStats, decode, encode
    from minisgl.scheduler.io import SchedulerServer

    assert extension.extensions().scheduler_messages[FlushCacheRequest] is handle_flush
    assert decode(encode(FlushCacheRequest(3))) == FlushCacheRequest(3)
    sent: list[Any] = []
    server = SchedulerServer.__new__(SchedulerServer)
    server.scheduler = SimpleNamespace(flush_cache=lambda: "cache_busy: 1 requests are running")
    server.send, server.dp_rank = SimpleNamespace(put=sent.append), 1
    server.stats = lambda: SchedulerStats(free_pages=9, dp_rank=1)  # type: ignore[method-assign]
    assert server.handle(FlushCacheRequest(api_rank=2)) is True
    error = "cache_busy: 1 requests are running"
    assert sent == [
        BatchMsg([], SchedulerStats(free_pages=9, dp_rank=1)),
        FlushCacheReply(1, error, 2),
    ]
