"""Schemathesis (an external API fuzzer) against the real server's own OpenAPI document, with
every check: no 5xx, every status, content type, header and body as the document says, invalid
bodies refused, 405s with `Allow`. A bounded, seeded run; afterwards the server is healthy and
holds nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

from support.server import SHORT_SERVER, Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
EXAMPLES_PER_OPERATION = 25
# A body the schema allows may still be refused for what the document cannot say (a model this
# server does not serve, a prompt longer than the context, two grammars at once): 400 counts as
# an answer to valid data here; the other checks still hold every answer to the document.
# CPython 3.11 before 3.11.8 (gh-106905) may report an error inside ast.parse as this
# SystemError; hypothesis parses its lambdas' source while schemathesis generates data (seen
# in CI and here on 3.11.7, in the coverage phase; here once in a run and its retry), so the
# client run, not the server, failed.
CPYTHON_AST_BUG = "SystemError: AST constructor recursion depth mismatch"
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404", "413"]
"""


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    # a short context: every accepted request generates little (test_fuzz's server too)
    return shared_server(*SHORT_SERVER)


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis not installed")
# One seed (issue 47: the suite in 10 minutes): --max-time makes each run 30 s whatever the seed,
# and one run reaches every operation in both the coverage and the fuzzing phase.
@pytest.mark.parametrize("seed", [0])
def test_schemathesis_finds_no_server_error_and_no_mismatch(
    server: Server, tmp_path, seed: int
) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
        f"{server.url}/openapi.json", "--checks", "all", "--max-examples",
        str(EXAMPLES_PER_OPERATION), "--seed", str(seed), "--workers", "2", "--no-color",
        "--generation-database", "none", "--request-timeout", "60", "--max-time", "30",
        "--max-response-time", "60",  # a correctness run on a shared CPU, not a benchmark
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    for _ in range(2):  # the fuzzer's own interpreter failed (twice in a row seen): again
        if CPYTHON_AST_BUG not in run.stdout:
            break
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
    stats = server.wait_idle()
    assert stats["in_flight"] == 0 and stats["leaked_pages"] == 0, stats


# The fuzzer reaches a streamed 200 only by chance within its time limit; each streaming path is
# held to the document here on every run.
STREAMED = {
    "/generate": {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3}},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 3},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 3,
    },
}


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis not installed")
@pytest.mark.parametrize("path", sorted(STREAMED))
def test_streamed_events_match_the_document(server: Server, path: str) -> None:
    import requests
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    body = dict(STREAMED[path])
    if "model" in body:
        body["model"] = server.get_json("/v1/models")["data"][0]["id"]
    response = requests.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    schema[path]["POST"].validate_response(response)  # raises on any mismatch
