"""The online serving benchmark: its workloads, SSE parsing and metrics on their own, then a CPU
run against real servers on a tiny model (a 2-rate sweep with its plot, a trace replay, the
shared-prefix mode against the radix cache and, through `--launch`, against `--cache naive`,
and a comparison plot of both)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from support.server import REPO, free_port, make_tiny_model, run_server
from support.tokenizer import build_tiny_tokenizer

sys.path.insert(0, os.path.join(REPO, "benchmark", "online"))

import bench_serving as bs  # noqa: E402

SCRIPT = os.path.join(REPO, "benchmark", "online", "bench_serving.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LATENCY_KEYS = ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"]


# ---- workloads ----------------------------------------------------------------------------
def test_random_requests_have_the_asked_lengths():
    reqs = bs.random_requests(20, 30, 7, 0.0, 50, seed=1)
    assert [len(r.prompt) for r in reqs] == [30] * 20 and {r.output_len for r in reqs} == {7}
    assert all(0 <= t < 50 for r in reqs for t in r.prompt)
    spread = bs.random_requests(200, 100, 10, 0.5, 50, seed=1)
    assert {len(r.prompt) for r in spread} <= set(range(50, 151))
    assert len({len(r.prompt) for r in spread}) > 20
    assert bs.random_requests(3, 30, 7, 0.0, 50, seed=1)[0] == reqs[0]  # seeded


def test_shared_prefix_requests_share_their_groups_prefix():
    reqs = bs.shared_prefix_requests(7, 3, 40, 5, 4, 1000, seed=0)
    assert all(len(r.prompt) == 45 and r.output_len == 4 for r in reqs)
    prefixes = [tuple(r.prompt[:40]) for r in reqs]
    assert prefixes[0] == prefixes[3] == prefixes[6] and prefixes[1] == prefixes[4]
    assert len(set(prefixes)) == 3  # the groups interleave
    assert len({tuple(r.prompt[40:]) for r in reqs}) == 7  # every suffix its own


def test_poisson_arrivals():
    times = bs.arrival_times(4000, 8.0, seed=0)
    assert times[0] == 0 and times == sorted(times)
    assert abs(times[-1] / 3999 - 1 / 8) < 0.1 / 8  # mean gap 1 / rate
    assert bs.arrival_times(5, math.inf, seed=0) == [0.0] * 5


def test_trace_replay(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 1500, "input_length": 20, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1250, "input_length": 6, "output_length": 2},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = bs.trace_requests(str(path), None, "ms", 2.0, 16, 100, seed=0)
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.0]  # sorted, ms, gaps doubled
    assert [(len(r.prompt), r.output_len) for r in reqs] == [(40, 5), (6, 2), (20, 3)]
    assert reqs[0].prompt[:20] == reqs[2].prompt  # blocks 7, 8 (16 tokens each) shared
    assert len(bs.trace_requests(str(path), 2, "s", 1.0, 16, 100, seed=0)) == 2

    path.write_text(json.dumps(lines[0]) + '\n{"timestamp": 3, "input_length": 5}\n')
    with pytest.raises(bs.BenchError, match=r"trace.jsonl:2: expected .*output_length"):
        bs.trace_requests(str(path), None, "s", 1.0, 16, 100, seed=0)
    path.write_text("")
    with pytest.raises(bs.BenchError, match="no requests"):
        bs.trace_requests(str(path), None, "s", 1.0, 16, 100, seed=0)


# ---- SSE parsing and metrics --------------------------------------------------------------
def sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def send_to(handler) -> bs.Result:
    async def go() -> bs.Result:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await bs.send(client, {"prompt": [1, 2, 3], "max_tokens": 4})

    return asyncio.run(go())


def text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def usage_chunk(completion: int) -> dict:
    usage = {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}
    return {"choices": [], "usage": usage}


def test_send_counts_tokens_from_usage_else_chunks():
    with_usage = sse(text("a"), text("bc"), text("", "length"), usage_chunk(4))
    r = send_to(lambda req: httpx.Response(200, content=with_usage))
    assert r.ok and (r.prompt_tokens, r.output_tokens) == (5, 4)
    assert len(r.itl) == 1 and 0 < r.ttft <= r.e2e  # the empty finish chunk is no token

    r = send_to(lambda req: httpx.Response(200, content=sse(text("a"), text(""), text("c"))))
    assert r.ok and (r.prompt_tokens, r.output_tokens, len(r.itl)) == (3, 3, 2)  # "" is a token
    assert not r.chunkless

    # a server that streams nothing before the end (no text): TTFT = e2e, and it is flagged
    r = send_to(lambda req: httpx.Response(200, content=sse(text("", "length"), usage_chunk(4))))
    assert r.ok and r.chunkless and r.output_tokens == 4 and r.itl == []
    s = bs.summarize([r], 1.0, 2.0, [50])
    assert s["chunkless"] == 1 and "warning: 1 streams sent nothing" in bs.summary_line(s, [50])


def test_send_native_generate():
    """--endpoint generate: SGLang's /generate body, minisgl's native events (token ids)."""
    seen: list[tuple[str, dict]] = []
    events = sse(
        {"token_ids": [7], "text": "a", "finished": False, "finish_reason": None},
        {"token_ids": [8, 9], "text": "bc", "finished": False, "finish_reason": None},
        {"token_ids": [], "text": "", "finished": True, "finish_reason": "length"},
    )

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.url.path, json.loads(req.content)))
        return httpx.Response(200, content=events)

    async def go() -> bs.Result:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            body = bs.request_body("generate", "m", [1, 2, 3], 4, temperature=0.0, priority=1)
            return await bs.send(client, body)

    r = asyncio.run(go())
    assert r.ok and (r.prompt_tokens, r.output_tokens, len(r.itl)) == (3, 3, 1)
    path, body = seen[0]
    assert path == "/generate" and body["input_ids"] == [1, 2, 3] and body["priority"] == 1
    assert body["sampling_params"] == {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0}


def test_send_reports_errors():
    r = send_to(lambda req: httpx.Response(400, json={"error": {"message": "too long"}}))
    assert not r.ok and r.error.startswith("HTTP 400") and "too long" in r.error
    r = send_to(lambda req: httpx.Response(200, content=sse(text("a"), {"error": "boom"})))
    assert not r.ok and "boom" in r.error
    r = send_to(lambda req: httpx.Response(200, content=b"data: 5\n\n"))
    assert not r.ok and "no JSON object" in r.error
    r = send_to(lambda req: httpx.Response(200, content=b"data: [DONE]\n\n"))
    assert not r.ok and "without output" in r.error


def test_percentiles_as_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        got = bs.distribution(values, [0, 1, 50, 90, 99.9, 100])
        for p in (0, 1, 50, 90, 99.9, 100):
            assert got[f"p{p:g}"] == pytest.approx(np.percentile(values, p) * 1000, abs=1e-3)
        assert got["mean"] == pytest.approx(sum(values) / n * 1000, abs=1e-3)


def test_summarize():
    ok = [
        bs.Result(True, "", 10, 5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        bs.Result(True, "", 20, 3, ttft=0.3, e2e=0.5, itl=[0.1, 0.1]),
    ]
    s = bs.summarize([*ok, bs.Result(error="HTTP 500: x")], 2.0, math.inf, [50, 99])
    assert s["rate"] == "inf" and (s["completed"], s["failed"]) == (2, 1)
    assert s["errors"] == ["HTTP 500: x"]
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 8)
    assert (s["request_throughput"], s["output_throughput"]) == (1.0, 4.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (0.5-0.3)/2
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == 200.0
    assert s["e2e_ms"]["p99"] == pytest.approx(500.0)
    assert bs.summarize([], 1.0, 4.0, [50])["ttft_ms"] == {"mean": None, "p50": None}


def test_priority_mix_and_per_class_latencies():
    requests = bs.random_requests(10, 4, 2, 0.0, 100, seed=0)
    bs.assign_priorities(requests, 0.2, (-1, 0), seed=3)
    assert sorted(r.priority for r in requests) == [-1, -1] + [0] * 8
    again = bs.random_requests(10, 4, 2, 0.0, 100, seed=0)
    bs.assign_priorities(again, 0.2, (-1, 0), seed=3)
    assert [r.priority for r in again] == [r.priority for r in requests]  # seeded
    results = [
        bs.Result(True, "", 10, 3, ttft=0.1, e2e=0.3, itl=[0.1, 0.1], priority=-1),
        bs.Result(True, "", 10, 3, ttft=0.5, e2e=0.7, itl=[0.1, 0.1], priority=0),
        bs.Result(error="HTTP 500: x", priority=0),
    ]
    s = bs.summarize(results, 1.0, 8.0, [50])
    assert s["by_priority"].keys() == {"-1", "0"}
    high, low = s["by_priority"]["-1"], s["by_priority"]["0"]
    assert (high["completed"], high["failed"], low["completed"], low["failed"]) == (1, 0, 1, 1)
    assert (high["ttft_ms"]["p50"], low["ttft_ms"]["p50"]) == (100.0, 500.0)
    assert "by_priority" not in bs.summarize([bs.Result(True, "", 1, 1)], 1.0, 1.0, [50])


def test_bad_input_is_one_line(tmp_path, capsys):
    bad = (["--priority-mix", "0"], ["--priority-mix", "1.5"], ["--priority-values", "1,1"])
    for argv in (["--rates", "0"], ["--rates", "4,x"], ["--plot-only", "a.json"], *bad):
        with pytest.raises(SystemExit) as e:
            bs.main(argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit):
        bs.main(["--trace", "t.jsonl", "--rates", "4"])
    assert "--rates does not apply to --trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.main(["--save-detailed"])
    assert "--save-detailed needs --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.main(["--server-pid", str(2**22 + 1)])  # above Linux's largest pid
    assert "no such process" in capsys.readouterr().err

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert bs.main(["--base-url", url, "--disable-tqdm"]) == 1
    assert f"error: cannot reach {url}" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert bs.main(["--plot-only", str(tmp_path / "bad.json"), "--plot", "x.png"]) == 1
    assert "bad.json: cannot read it" in capsys.readouterr().err


# ---- against real servers -----------------------------------------------------------------
def check_result(path: str, rates: list, num_prompts: int, input_len: int, output_len: int):
    with open(path) as f:
        run = json.load(f)
    assert {"label", "title", "config", "host", "command", "results"} <= run.keys()
    assert [s["rate"] for s in run["results"]] == rates
    for s in run["results"]:
        assert (s["completed"], s["failed"]) == (num_prompts, 0), s["errors"]
        assert s["total_input_tokens"] == num_prompts * input_len
        assert s["total_output_tokens"] == num_prompts * output_len  # ignore_eos + max_tokens
        assert s["request_throughput"] > 0 and s["output_throughput"] > 0
        for key in LATENCY_KEYS:
            assert set(s[key]) == {"mean", "p50", "p90", "p99"}
            assert 0 <= s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
        assert 0 < s["ttft_ms"]["p50"] and s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    return run


def check_png(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.getsize(path) < 200_000  # small enough to commit


def record_prompts(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompts of every request bs.main sends from now on."""
    prompts, send = [], bs.send

    async def recording(client, body: dict) -> bs.Result:
        prompts.append(body.get("prompt") or body["input_ids"])
        return await send(client, body)

    monkeypatch.setattr(bs, "send", recording)
    return prompts


def test_against_the_cpu_server(tmp_path, capsys, monkeypatch):
    model = make_tiny_model(str(tmp_path / "tiny-qwen3"))
    vocab = len(build_tiny_tokenizer())  # 480, under the model's 512 embedding rows
    # no --vocab-size: the ids stay below the vocab_size of minisgl's /v1/models
    # one client process: record_prompts sees its sends (the default depends on the CPUs)
    common = ["--num-prompts", "6", "--output-len", "5", "--client-procs", "1"]
    sweep, sweep_png = str(tmp_path / "sweep.json"), str(tmp_path / "sweep.png")
    trace, replayed = tmp_path / "trace.jsonl", str(tmp_path / "trace.json")
    lines = [{"timestamp": t, "input_length": 24, "output_length": 5} for t in (0, 0.2, 0.3, 0.5)]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # the shared-prefix workload one request at a time: every repeat of a group's prefix can hit
    shared = ["--shared-prefix", "--num-groups", "2", "--prefix-len", "32", "--suffix-len", "4"]
    shared += ["--max-concurrency", "1", "--disable-tqdm", *common]
    radix, naive = str(tmp_path / "radix.json"), str(tmp_path / "naive.json")
    jsonl = str(tmp_path / "results.jsonl")
    with run_server(model, "--page-size", "4", log_path=str(tmp_path / "server.log")) as server:
        assert server.get_json("/v1/models")["data"][0]["vocab_size"] == vocab
        argv = ["--base-url", server.url + "/v1", "--rates", "30,inf", "--input-len", "24"]
        argv += ["--priority-mix", "0.5", "--json", jsonl, "--note", "tiny"]
        prompts = record_prompts(monkeypatch)
        assert bs.main([*argv, *common, "--out", sweep, "--plot", sweep_png]) == 0
        assert re.search(r"rate 30: 100%.*6/6", capsys.readouterr().err)  # the progress bar
        assert len(prompts) == 12 and max(max(p) for p in prompts) < vocab
        metrics = httpx.get(f"{server.url}/metrics").text  # the server saw both classes
        # 3 of each class at each of 2 rates, and the warm-up request at the default 0
        for label, count in (("-1", 6), ("0", 7)):
            line = f'minisgl_time_to_first_token_seconds_count{{priority="{label}"}} '
            assert float(metrics.split(line, 1)[1].split()[0]) == count
        assert max(max(p) for p in prompts) >= vocab - 50  # drawn up to it, not below 400
        argv = ["--base-url", server.url, "--trace", str(trace), "--vocab-size", "400"]
        prompts.clear()
        assert bs.main([*argv, "--disable-tqdm", "--out", replayed]) == 0
        assert len(prompts) == 4 and max(max(p) for p in prompts) < 400  # the flag wins
        argv = ["--base-url", server.url, *shared, "--label", "radix", "--out", radix]
        assert bs.main(argv) == 0
        native = str(tmp_path / "native.json")  # SGLang's /generate (sglang-router's way)
        argv = ["--base-url", server.url, "--endpoint", "generate", "--input-len", "24"]
        assert bs.main([*argv, "--disable-tqdm", *common, "--out", native]) == 0
    run = check_result(sweep, [30.0, "inf"], 6, 24, 5)
    assert run["config"]["model"] == model  # asked from /v1/models
    assert run["config"]["vocab_size"] == vocab
    assert "num_preemptions" in run["results"][0]["server_stats"]  # minisgl's /stats
    check_png(sweep_png)
    with open(jsonl) as f:  # one line per rate, as results.jsonl keeps them
        lines = [json.loads(line) for line in f]
    assert [line["rate"] for line in lines] == [30.0, "inf"]
    for line in lines:
        assert line["note"] == "tiny" and "--priority-mix 0.5" in line["command"]
        assert line["model"] == model and {"gpu", "date", "commit"} <= line.keys()
        assert line["completed"] == 6 and line["output_throughput"] > 0
        high, low = line["by_priority"]["-1"], line["by_priority"]["0"]
        assert high["completed"] == low["completed"] == 3  # the server took both classes
        assert high["ttft_ms"]["p50"] > 0 and low["ttft_ms"]["p99"] > 0
    check_result(native, ["inf"], 6, 24, 5)
    run = check_result(replayed, ["trace"], 4, 24, 5)
    assert run["results"][0]["duration_s"] >= 0.5  # the last request arrived at 0.5 s
    hits_before = run["results"][0]["server_stats"]["cached_tokens"]
    run = check_result(radix, ["inf"], 6, 36, 5)
    assert run["label"] == "radix" and "shared prefix" in run["title"]
    # the 4 requests after each group's first found its 32-token prefix in the radix cache
    # (the warm-up request, the same in every run, can add at most 15)
    assert run["results"][0]["server_stats"]["cached_tokens"] - hits_before >= 4 * 32

    # the same workload against a server launched with --cache naive: no prefix is reused;
    # with two API processes, each one's CPU share is reported
    port = free_port()
    env = f"PYTHONPATH={os.path.join(REPO, 'python')}"
    cmd = ["env", env, sys.executable, "-m", "minisgl", "--model", model, "--page-size", "4"]
    cmd += ["--cache", "naive", "--port", str(port), "--api-server-count", "2"]
    argv = ["--launch", shlex.join(cmd), "--launch-log", str(tmp_path / "naive.log")]
    assert bs.main([*argv, *shared, "--label", "naive", "--out", naive]) == 0
    run = check_result(naive, ["inf"], 6, 36, 5)
    assert run["label"] == "naive" and run["results"][0]["server_stats"]["cached_tokens"] == 0
    each = run["results"][0]["server_busy_each"]
    assert len(each) == 2 and run["results"][0]["server_busy"] == max(each)

    both = str(tmp_path / "both.png")
    assert bs.main(["--plot-only", radix, naive, "--plot", both]) == 0
    check_png(both)


FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": {}, "/v1/models": {"data": [{"id": "fake"}]}}.get(self.path)
        self.send_response(404 if body is None else 200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.end_headers()
        for _ in range(req["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\\n\\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(req["prompt"]), "completion_tokens": req["max_tokens"]}
        last = json.dumps({"choices": [], "usage": usage})
        self.wfile.write(f"data: {last}\\n\\ndata: [DONE]\\n\\n".encode())

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[-1])), Handler).serve_forever()
"""


def test_launch_starts_and_stops_the_server(tmp_path, capsys):
    """--launch on a stand-in server (a real one starts too slowly for a second test)."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port, out = free_port(), str(tmp_path / "fake.json")
    argv = ["--launch", f"{sys.executable} {script} --port {port}", "--num-prompts", "5"]
    argv += ["--rates", "100", "--input-len", "8", "--output-len", "3", "--disable-tqdm"]
    argv += ["--launch-log", str(tmp_path / "fake.log"), "--client-procs", "2"]
    before = time.time()
    assert bs.main([*argv, "--out", out, "--save-detailed"]) == 0  # URL from --launch's --port
    run = check_result(out, [100.0], 5, 8, 3)
    detail = run["results"][0]["requests"]  # --save-detailed: each request, in request order
    assert [(d["ok"], d["output_tokens"], d["prompt_tokens"]) for d in detail] == [(True, 3, 8)] * 5
    duration = run["results"][0]["duration_s"]
    assert before <= run["results"][0]["started_at"] <= time.time()  # Unix time, to meet logs
    for d in detail:
        assert 0 <= d["sent_s"] < duration and 0 < d["ttft_ms"] <= d["e2e_ms"] < duration * 1000
        assert len(d["itl_ms"]) <= 2 and d["ttft_ms"] + sum(d["itl_ms"]) <= d["e2e_ms"]
    assert run["config"]["model"] == "fake" and run["results"][0]["server_stats"] is None
    assert run["results"][0]["client_procs"] == 2 and 0 <= run["results"][0]["client_busy"] < 1
    assert 0 <= run["results"][0]["server_busy"] < 1.5  # --launch's process, read from /proc
    # a server whose model card has no vocab_size (as vLLM's): the fallback, said once
    assert run["config"]["vocab_size"] == bs.FALLBACK_VOCAB
    assert capsys.readouterr().err.count("does not give vocab_size") == 1
    with pytest.raises(httpx.ConnectError):  # stopped
        httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False)

    crash = f"{sys.executable} -c 'import sys; print(\"no GPU\"); sys.exit(3)'"
    assert bs.main(["--launch", crash, "--launch-log", str(tmp_path / "crash.log")]) == 1
    err = capsys.readouterr().err
    assert "the server exited with code 3 before it was ready" in err and "no GPU" in err

    hang = f"{sys.executable} -c 'import time; time.sleep(60)'"
    argv = ["--launch", hang, "--launch-timeout", "1", "--launch-log", str(tmp_path / "hang.log")]
    assert bs.main(argv) == 1
    err = capsys.readouterr().err
    assert "/health not ready after 1 s" in err
    pid = int(re.search(r"launched the server \(pid (\d+)\)", err).group(1))
    assert not os.path.exists(f"/proc/{pid}")  # stopped and reaped


def test_client_procs_share_a_rate_and_keep_the_order(tmp_path, capsys):
    """--client-procs 2: two processes send the requests on one schedule; each result comes
    back in its request's place, and a saturated client is named in the summary."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    server = bs.launch(
        f"{sys.executable} {script} --port {port}",
        f"http://127.0.0.1:{port}",
        30,
        str(tmp_path / "fake.log"),
    )
    try:
        args = bs.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--client-procs", "2"])
        requests = [bs.Request([1] * (3 + i), 1 + i % 4, priority=i % 2) for i in range(7)]
        times = [0.0, 0.0, 0.1, 0.1, 0.2, 0.3, 0.6]
        procs = bs.ClientProcs(2, args)
        try:
            bar = SimpleNamespace(n=0, update=lambda n=1: None)
            results, start, end, busy = asyncio.run(procs.run(args, "fake", requests, times, bar))
        finally:
            procs.close()
    finally:
        bs.stop(server)
    assert [(r.ok, r.prompt_tokens, r.output_tokens) for r in results] == [
        (True, 3 + i, 1 + i % 4) for i in range(7)
    ]
    assert [r.priority for r in results] == [i % 2 for i in range(7)]
    assert end - start >= 0.6 and 0 <= busy < 1  # the last one waited for its arrival

    with pytest.raises(SystemExit):
        bs.main(["--max-concurrency", "4", "--client-procs", "2"])
    assert "--max-concurrency needs --client-procs 1" in capsys.readouterr().err
    assert bs.parse_args(["--max-concurrency", "4"]).client_procs == 1
    summary = {**bs.summarize([results[0]], 1.0, 8.0, [50]), "client_busy": 0.97}
    assert "a client process was busy 97% of the run" in bs.summary_line(summary, [50])


# ---- without the bench extra --------------------------------------------------------------
WITHOUT_EXTRA = """
import runpy, sys
for name in ("httpx", "matplotlib", "numpy", "tqdm"):
    sys.modules[name] = None  # import fails as if not installed
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without_extra(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", WITHOUT_EXTRA, SCRIPT, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_help_and_a_clear_error_without_the_bench_extra(tmp_path):
    out = run_without_extra("--help")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "vocab_size of the server's model card" in " ".join(out.stdout.split())  # --vocab-size

    url = f"http://127.0.0.1:{free_port()}"
    extra = "pip install 'minisgl[bench]'"
    out = run_without_extra("--base-url", url, "--plot", str(tmp_path / "x.png"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr == f"error: this needs httpx, tqdm and matplotlib, not installed: {extra}\n"
    out = run_without_extra("--plot-only", str(tmp_path / "a.json"), "--plot", "x.png")
    assert out.returncode == 1
    assert out.stderr == f"error: this needs matplotlib, not installed: {extra}\n"
