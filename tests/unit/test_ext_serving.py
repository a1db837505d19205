"""The serving extension (`minisgl/ext/serving`: SGLang's routes, Prometheus metrics) and the
core without it (issue 46): the extension fills its points; with MINISGL_DISABLE_EXTENSIONS=1 a
real server answers SGLang's endpoints and /metrics 404 as it does any unknown route, refuses
every undeclared /generate field with a 400 naming it, counts nothing, and still serves /stats
and /generate; `--dp 2` and `LLM(dp=2)` are refused as needing the extension. The core-alone tests carry the `core` mark (.ci/run runs them without ext/)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from minisgl import LLM, extension
from minisgl.extension import RequestObserver
from minisgl.message import UserReply
from minisgl.server.frontend import Frontend
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


def test_the_extension_fills_its_points() -> None:
    from minisgl.ext.serving import metrics, sglang

    points = extension.extensions()
    assert sglang.add_sglang_routes in points.routes
    assert metrics.add_metrics_route in points.routes
    assert points.generate_extras is sglang.check_generate_extras
    assert points.request_observer is metrics.frontend_metrics
    from minisgl.ext.serving import dispatch, replicas

    assert points.dispatcher is dispatch.Dispatcher
    assert points.replicas is replicas.Replicas


@pytest.mark.core
def test_the_core_alone_counts_nothing(core_alone: None, tmp_path: Any) -> None:
    """The Frontend's observer is the do-nothing default: a view carries no metrics text."""
    addr = f"ipc://{tmp_path}/api"
    frontend = Frontend([f"ipc://{tmp_path}/tok"], addr)
    assert type(frontend.metrics) is RequestObserver
    frontend.metrics.reply(0, 0.0, None, UserReply(0, "x", [1], True, "stop", 1, 1), 1.0)
    assert frontend.view(0, metrics=True).metrics == ""


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
def test_dp_is_refused_on_the_command_line_without_it(tmp_path: Any) -> None:
    python = str(Path(__file__).resolve().parents[2] / "python")
    env = dict(os.environ, MINISGL_DISABLE_EXTENSIONS="1", PYTHONPATH=python)
    argv = [sys.executable, "-m", "minisgl", "--model", str(tmp_path), "--dp", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("python -m minisgl: error: argument --dp: --dp 2"), line
    assert NEEDS_SERVING in line, line


@pytest.mark.core
def test_llm_dp_is_refused_without_it(core_alone: None, tmp_path: Any) -> None:
    with pytest.raises(OptionError, match=NEEDS_SERVING) as refused:
        LLM(str(tmp_path), dp=2, device="cpu")
    assert refused.value.name == "dp" and isinstance(refused.value, ValueError)
    assert extension.extensions().dispatcher is None and extension.extensions().replicas is None
