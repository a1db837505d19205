"""Multi-node tensor parallelism (issue 21) on one machine: two launches of `python -m minisgl`
(--nnodes 2, --node-rank 0 and 1, --tp 2) meet at a TCP store on loopback and form one gloo
group; their greedy tokens equal TP=1's. Node 1 ends when node 0 does (0 after its clean stop,
non-zero when it is killed), leaving no process behind; /flush_cache reaches both ranks; bad
flags fail with a message naming the flag."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from minisgl import LLM, SamplingParams
from support.models import save_model
from support.server import REPO, Server, alive, descendants, free_port, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 8, 100, 200, 3, 9, 9, 9, 10, 11]]
ENGINE = ["--page-size", "4", "--num-pages", "64"]
MAX_TOKENS = 8


def launch(*args: str, log: str) -> tuple[subprocess.Popen, object]:
    """`python -m minisgl ARGS` with its output in `log` (a node without HTTP)."""
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), PYTHONUNBUFFERED="1")
    out = open(log, "wb")
    cmd = [sys.executable, "-m", "minisgl", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, out


def generate(url: str, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())["output_ids"]


@contextlib.contextmanager
def two_nodes(model: str, tmp_path) -> Iterator[tuple[Server, subprocess.Popen]]:
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model", model, "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, *ENGINE]
    node1, out1 = launch(*common, "--node-rank", "1", log=str(tmp_path / "node1.log"))
    node0 = Server(None, *common, "--node-rank", "0", log_path=str(tmp_path / "node0.log"))
    try:
        node0.wait_ready()
        yield node0, node1
    finally:
        node0.kill_all()
        if node1.poll() is None:
            node1.kill()
        node1.wait()
        out1.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_two_nodes_match_tp1(arch: str, tmp_path) -> None:
    path = str(tmp_path / arch)
    save_model(arch, path)
    single = LLM(path, page_size=4, num_pages=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o["token_ids"] for o in single.generate(PROMPTS, params, use_tqdm=False)]
    single.shutdown()
    with two_nodes(path, tmp_path) as (node0, node1):
        assert [generate(node0.url, p) for p in PROMPTS] == expected
        # every rank empties its cache (or their batches, and collectives, would differ)
        flush = urllib.request.Request(f"{node0.url}/flush_cache", b"", method="POST")
        with urllib.request.urlopen(flush, timeout=10) as r:
            assert r.status == 200
        assert node0.stats()["cached_pages"] == 0
        assert [generate(node0.url, p) for p in reversed(PROMPTS)] == expected[::-1]
        ranks = descendants(node1.pid)
        assert node0.get_json("/server_info")["tp_size"] == 2
        if arch == "llama":  # a clean stop: rank 0 tells node 1's ranks to stop
            assert node0.stop() == 0
            assert node1.wait(timeout=15) == 0
        else:  # rank 0 killed outright: node 1 finds it gone
            os.kill(node0.proc.pid, signal.SIGKILL)
            assert node1.wait(timeout=15) != 0
            node0.assert_no_survivors()
    wait_for(lambda: not alive(ranks), 5, "node 1's ranks to exit")


def test_node_rank_out_of_range(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "--nnodes", "2", "--node-rank", "2"],
        env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--node-rank: must be in 0..1" in proc.stderr


def test_unreachable_dist_init_addr_fails_within_the_timeout(tmp_path) -> None:
    """Node 1 with nobody listening at --dist-init-addr: an error naming the flag once
    --dist-timeout runs out, exit 1, no process left."""
    path = str(tmp_path / "llama")
    save_model("llama", path)
    args = ["--model", path, "--tp", "2", "--nnodes", "2", "--node-rank", "1"]
    args += ["--dist-init-addr", f"127.0.0.1:{free_port()}", "--dist-timeout", "2", *ENGINE]
    log = str(tmp_path / "node1.log")
    proc, out = launch(*args, log=log)
    time.sleep(1)
    children = descendants(proc.pid)
    try:
        code = proc.wait(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    text = open(log).read()
    assert code == 1, text
    assert "--dist-init-addr" in text and "--dist-timeout 2" in text, text
    wait_for(lambda: not alive(children), 5, "no process left")
