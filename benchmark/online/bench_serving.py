"""Online serving benchmark for any OpenAI-compatible server (minisgl, vLLM, SGLang).

Streams /v1/completions requests with token-id prompts (exact input lengths), `ignore_eos` and
`max_tokens` (exact output lengths). Arrivals are Poisson at each rate of a sweep (`inf`: all at
once) or replayed from a JSONL trace. Reports request and token throughput and the TTFT / ITL /
TPOT / end-to-end latency percentiles; writes a JSON result and a PNG plot.

    # a rate sweep on random prompts
    python benchmark/online/bench_serving.py --base-url http://127.0.0.1:1919 \\
        --rates 4,8,16,32,inf --num-prompts 200 --input-len 512 --output-len 256 \\
        --out results/sweep.json --plot results/sweep.png
    # many requests sharing a few long system prompts (radix cache vs --cache naive)
    python benchmark/online/bench_serving.py --shared-prefix --num-groups 8 --prefix-len 2000 \\
        --suffix-len 100 --output-len 64 --rates 8,inf --label radix --out results/radix.json \\
        --launch "python -m minisgl --model Qwen/Qwen3-0.6B --dummy-weights --port 1919"
    # replay a trace (one JSON object per line: timestamp, input_length, output_length)
    python benchmark/online/bench_serving.py --trace qwen_traceA_blksz_16.jsonl --num-prompts 500
    # draw several results on one figure
    python benchmark/online/bench_serving.py --plot-only radix.json naive.json --plot cmp.png
    # 20 % of the requests at high priority; one JSON line per rate appended to results.jsonl
    python benchmark/online/bench_serving.py --rates 32 --priority-mix 0.2 \
        --json benchmark/results.jsonl --note "H100, default server"

Metrics (as vLLM's benchmark_serving): TTFT = time to the first token chunk (text, or an empty
delta before the closing chunk); ITL = gaps between successive token chunks; TPOT = (e2e -
TTFT) / (output tokens - 1); output tokens come from the usage the server reports
(`stream_options.include_usage`), else from the chunk count.
Throughput divides by the wall time from the first request sent to the last one finished.

Each rate gets fresh prompts (seed + rate index): prompts repeated across rates would hit the
prefix cache of a server that cached them during the previous rate. Runs against one server
need seeds of their own: a warm-up run with the same --seed sends the measured run's prompts
(session 58 saw bursts 5-25 % "faster" that way)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # the bench extra is imported where it is used: --help works without it
    import httpx

BENCH_EXTRA = "pip install 'minisgl[bench]'"
# prompt ids are drawn below this when the server does not say its vocabulary size (every real
# LLM's is larger; minisgl's /v1/models says it)
FALLBACK_VOCAB = 10000
RUN_MODULES = ["httpx", "tqdm"]  # what a benchmark run needs; --plot: matplotlib too
BUSY_CLIENT = 0.8  # a client process busier than this (CPU over wall time) delays what it reads
BUSY_SERVER = 0.9  # a server process this busy is close to a core's worth: it may be the limit
LATENCIES = [("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")]


class BenchError(Exception):
    """A problem with the input or the server, printed as one line (no traceback)."""


@dataclass
class Request:
    prompt: list[int]
    output_len: int
    arrival: float = 0.0  # seconds after the start (traces only)
    priority: int | None = None  # sent as the request's `priority` (--priority-mix)


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunkless: bool = False  # the server streamed nothing before the end: TTFT is the e2e
    priority: int | None = None
    sent: float = 0.0  # time.monotonic() when it was sent (--save-detailed)


# ---- workloads -----------------------------------------------------------------------------
def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int
) -> list[Request]:
    """Prompts of random ids; lengths uniform in [len * (1 - r), len * (1 + r)]."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        lo = max(1, round(mean * (1 - range_ratio)))
        return rng.randint(lo, max(lo, round(mean * (1 + range_ratio))))

    return [
        Request(random_tokens(rng, length(input_len), vocab), length(output_len)) for _ in range(n)
    ]


def shared_prefix_requests(
    n: int, groups: int, prefix_len: int, suffix_len: int, output_len: int, vocab: int, seed: int
) -> list[Request]:
    """Request i = prefix of group i % groups + its own suffix: the groups interleave, so only a
    prefix cache that keeps each group's prefix across requests saves the prefill."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, prefix_len, vocab) for _ in range(groups)]
    return [
        Request(prefixes[i % groups] + random_tokens(rng, suffix_len, vocab), output_len)
        for i in range(n)
    ]


def trace_requests(
    path: str,
    limit: int | None,
    time_unit: str,
    time_scale: float,
    block_size: int,
    vocab: int,
    seed: int,
) -> list[Request]:
    """One request per JSONL line: `timestamp`, `input_length`, `output_length`; the optional
    `hash_ids` (one per `block_size` prompt tokens, as in the Qwen-Bailian and Mooncake traces)
    become equal token blocks, so requests share the prefixes the trace says they share."""
    entries = []
    try:
        with open(path) as f:
            for num, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    e = json.loads(line)
                    t, n_in, n_out = (
                        float(e["timestamp"]),
                        int(e["input_length"]),
                        int(e["output_length"]),
                    )
                    hashes = list(e.get("hash_ids") or [])
                except (ValueError, KeyError, TypeError) as ex:
                    raise BenchError(
                        f"{path}:{num}: expected a JSON object with timestamp, input_length and "
                        f"output_length ({type(ex).__name__}: {ex})"
                    ) from None
                if n_in < 1 or n_out < 1 or not math.isfinite(t):
                    raise BenchError(f"{path}:{num}: lengths must be >= 1 and timestamp finite")
                entries.append((t, n_in, n_out, hashes))
                if limit is not None and len(entries) == limit:
                    break
    except OSError as e:
        raise BenchError(f"cannot read the trace: {e}") from None
    if not entries:
        raise BenchError(f"{path}: no requests in the trace")
    entries.sort(key=lambda e: e[0])
    rng, blocks = random.Random(seed), {}
    unit = 1e-3 if time_unit == "ms" else 1.0
    requests = []
    for t, n_in, n_out, hashes in entries:
        prompt = []
        for h in hashes:
            if h not in blocks:
                blocks[h] = random_tokens(random.Random(f"{seed}:{h}"), block_size, vocab)
            prompt += blocks[h]
        prompt = prompt[:n_in] + random_tokens(rng, max(0, n_in - len(prompt)), vocab)
        requests.append(Request(prompt, n_out, (t - entries[0][0]) * unit * time_scale))
    return requests


def assign_priorities(
    requests: list[Request], fraction: float, values: tuple[int, int], seed: int
) -> None:
    """round(fraction * n) requests, drawn at random, get the high priority values[0]; the
    others values[1]."""
    high = set(random.Random(seed).sample(range(len(requests)), round(fraction * len(requests))))
    for i, req in enumerate(requests):
        req.priority = values[0] if i in high else values[1]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1 / rate, the first request at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


# ---- one streamed request ------------------------------------------------------------------
async def sse_events(r: httpx.Response) -> AsyncIterator[tuple[float, dict]]:
    """(arrival time of the network read, parsed JSON) of each `data:` event until [DONE]; one
    layer over the raw bytes, because the client's cost per chunk bounds what it can measure."""
    pending = b""
    async for data in r.aiter_bytes():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                msg = json.loads(payload)
                if not isinstance(msg, dict):
                    raise ValueError(f"an SSE event that is no JSON object: {payload[:100]!r}")
                yield now, msg


def request_body(endpoint: str, model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    """The streamed request: OpenAI's /v1/completions, or SGLang's native /generate (token ids
    in `input_ids`: what sglang-router routes by tokens; its /v1/completions takes text only)."""
    if endpoint == "generate":
        params = {"max_new_tokens": max_tokens, "ignore_eos": True, **extra}
        priority = params.pop("priority", None)
        body = {"model": model, "input_ids": prompt, "sampling_params": params, "stream": True}
        return body if priority is None else {**body, "priority": priority}
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def token_event(msg: dict, res: Result) -> bool | None:
    """Whether an event carries tokens (None: no choice at all, nothing to time); a native
    /generate event counts its token ids, a completions one reports usage at the end."""
    if "token_ids" in msg:  # minisgl's native stream
        res.output_tokens += len(msg["token_ids"])
        return bool(msg["token_ids"])
    if usage := msg.get("usage"):
        res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
        res.output_tokens = usage.get("completion_tokens", 0)
    choices = msg.get("choices") or []
    if not choices:
        return None
    # a token event: text, or an empty delta that is not the closing chunk (vLLM streams those
    # for tokens that decode to no text yet)
    return bool(choices[0].get("text")) or choices[0].get("finish_reason") is None


async def send(client: httpx.AsyncClient, body: dict) -> Result:
    import httpx

    native = "input_ids" in body
    res = Result(prompt_tokens=len(body["input_ids"] if native else body["prompt"]))
    start = time.perf_counter()
    last = first_choice = None
    try:
        path = "/generate" if native else "/v1/completions"
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:300]}"
                return res
            async for now, msg in sse_events(r):
                if msg.get("error"):  # vLLM / SGLang report mid-stream errors this way
                    res.error = f"stream error: {msg['error']}"
                    return res
                tokens = token_event(msg, res)
                if tokens is None:
                    continue
                first_choice = first_choice or now
                if tokens:
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a malformed event
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    if last is None and first_choice is not None:  # only the closing chunk came
        res.ttft, res.chunkless = first_choice - start, True
    res.output_tokens = res.output_tokens or len(res.itl) + (last is not None)
    res.ok = res.output_tokens > 0
    if not res.ok:
        res.error = "the stream ended without output"
    return res


# ---- metrics -------------------------------------------------------------------------------
def percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy.percentile's default)."""
    pos = (len(ordered) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, **{f"p{p:g}": None for p in percentiles}}
    ms = sorted(v * 1000 for v in values_s)
    out: dict[str, float | None] = {"mean": round(math.fsum(ms) / len(ms), 3)}
    for p in percentiles:
        out[f"p{p:g}"] = round(percentile(ms, p), 3)
    return out


def summarize(
    results: list[Result], duration: float, rate: float | str, percentiles: list[float]
) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "rate": "inf" if rate == math.inf else rate,
        "duration_s": round(duration, 3),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "chunkless": sum(r.chunkless for r in ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
    }
    summary.update(latencies(ok, percentiles))
    classes = sorted({r.priority for r in results if r.priority is not None})
    if classes:  # --priority-mix: the latencies of each priority class
        summary["by_priority"] = {
            str(value): {
                "completed": sum(r.priority == value for r in ok),
                "failed": sum(r.priority == value and not r.ok for r in results),
                **latencies([r for r in ok if r.priority == value], percentiles),
            }
            for value in classes
        }
    return summary


def latencies(ok: list[Result], percentiles: list[float]) -> dict[str, dict]:
    """TTFT, ITL, TPOT and end-to-end distributions (ms) of the completed requests `ok`."""
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "ttft_ms": distribution([r.ttft for r in ok], percentiles),
        "itl_ms": distribution([x for r in ok for x in r.itl], percentiles),
        "tpot_ms": distribution(tpot, percentiles),
        "e2e_ms": distribution([r.e2e for r in ok], percentiles),
    }


# ---- the run -------------------------------------------------------------------------------
# One Python process parses at most ~20,000 streamed events a second (httpx, ~50 us each on a
# server CPU); past that its own delays enter the latencies it measures. --client-procs splits
# a rate's requests over several processes, each with its own event loop and connections.
_finished: Any = None  # a client process's count of finished requests, shared with the parent


def http_client(args: argparse.Namespace) -> httpx.AsyncClient:
    import httpx

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=timeout, limits=limits, trust_env=False
    )


async def send_all(
    client: httpx.AsyncClient,
    requests: list[Request],
    times: list[float],
    start: float,
    args: argparse.Namespace,
    model: str,
    done: Callable[[], None],
) -> list[Result]:
    """Each request sent at `start` + its arrival time (time.monotonic(): one clock for every
    client process of the host)."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def one(req: Request, at: float) -> Result:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        extra: dict = {"temperature": args.temperature}
        if req.priority is not None:
            extra["priority"] = req.priority
        body = request_body(args.endpoint, model, req.prompt, req.output_len, **extra)
        sent = time.monotonic()
        if limit is None:
            res = await send(client, body)
        else:
            async with limit:
                sent = time.monotonic()
                res = await send(client, body)
        res.priority, res.sent = req.priority, sent
        done()
        return res

    return list(await asyncio.gather(*(one(r, t) for r, t in zip(requests, times))))


def start_client_proc(finished: Any) -> None:
    global _finished
    _finished = finished


def warm_client_proc(args: argparse.Namespace) -> None:
    """One round trip (GET /v1/models), so that a process's first timed request does not pay
    for its lazy imports and first connection (150-250 ms on an H100 host's CPU)."""

    async def get() -> None:
        async with http_client(args) as client:
            await client.get("/v1/models")

    time.sleep(0.3)  # each process takes one of the n calls
    asyncio.run(get())


def count_finished() -> None:
    with _finished.get_lock():
        _finished.value += 1


def client_share(
    args: argparse.Namespace, model: str, requests: list[Request], times: list[float], start: float
) -> tuple[list[Result], float, float]:
    """One client process's share of a rate: its results, when it ended and its CPU seconds."""

    async def run() -> tuple[list[Result], float, float]:
        async with http_client(args) as client:
            cpu = time.process_time()
            results = await send_all(client, requests, times, start, args, model, count_finished)
            return results, time.monotonic(), time.process_time() - cpu

    return asyncio.run(run())


class ClientProcs:
    """--client-procs N > 1: N spawned processes, started once, that share each rate."""

    def __init__(self, n: int, args: argparse.Namespace) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # no fork of a running event loop
        self.n, self.finished = n, ctx.Value("l", 0)
        self.pool = ProcessPoolExecutor(
            n, mp_context=ctx, initializer=start_client_proc, initargs=(self.finished,)
        )
        list(self.pool.map(warm_client_proc, [args] * n))  # each process started and warm

    async def run(
        self,
        args: argparse.Namespace,
        model: str,
        requests: list[Request],
        times: list[float],
        bar: Any,
    ) -> tuple[list[Result], float, float, float]:
        """Results in the order of `requests`, the start, the end, the busiest process's share."""
        self.finished.value = 0
        shares = [range(i, len(requests), self.n) for i in range(self.n)]
        start = time.monotonic() + 0.2  # every process holds its share before the first arrival
        loop = asyncio.get_running_loop()
        futures = [
            loop.run_in_executor(
                self.pool,
                client_share,
                args,
                model,
                [requests[j] for j in share],
                [times[j] for j in share],
                start,
            )
            for share in shares
            if share
        ]
        while not all(f.done() for f in futures):
            await asyncio.wait(futures, timeout=0.25)
            bar.update(self.finished.value - bar.n)
        outs = [f.result() for f in futures]
        results: list[Result] = [Result()] * len(requests)
        for share, (share_results, _, _) in zip(shares, outs):
            for j, res in zip(share, share_results):
                results[j] = res
        end = max(o[1] for o in outs)
        return results, start, end, max(o[2] for o in outs) / max(end - start, 1e-9)

    def close(self) -> None:
        self.pool.shutdown()


async def run_rate(
    client: httpx.AsyncClient,
    procs: ClientProcs | None,
    requests: list[Request],
    times: list[float],
    args: argparse.Namespace,
    model: str,
    desc: str,
) -> tuple[list[Result], float, float, float]:
    """The results, the run's wall time, the busiest client process's CPU share of it and the
    run's start (Unix time); each result's `sent` is made relative to that start."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc=desc, disable=args.disable_tqdm, file=sys.stderr)
    if procs is None:
        start, cpu = time.monotonic(), time.process_time()
        results = await send_all(client, requests, times, start, args, model, bar.update)
        end = time.monotonic()
        busy = (time.process_time() - cpu) / max(end - start, 1e-9)
    else:
        results, start, end, busy = await procs.run(args, model, requests, times, bar)
    bar.close()
    for res in results:
        res.sent = max(0.0, res.sent - start) if res.sent else 0.0
    started_at = time.time() - (time.monotonic() - start)  # the wall clock, as servers log it
    return results, end - start, busy, started_at


def workload(args: argparse.Namespace, index: int) -> list[Request]:
    requests = base_workload(args, args.seed + index)
    if args.priority_mix is not None:
        assign_priorities(requests, args.priority_mix, args.priority_values, args.seed + index)
    return requests


def base_workload(args: argparse.Namespace, seed: int) -> list[Request]:
    if args.trace:
        return trace_requests(
            args.trace,
            args.num_prompts,
            args.trace_time_unit,
            args.trace_time_scale,
            args.trace_block_size,
            args.vocab_size,
            seed,
        )
    n = args.num_prompts or 200
    if args.shared_prefix:
        return shared_prefix_requests(
            n,
            args.num_groups,
            args.prefix_len,
            args.suffix_len,
            args.output_len,
            args.vocab_size,
            seed,
        )
    return random_requests(
        n, args.input_len, args.output_len, args.range_ratio, args.vocab_size, seed
    )


async def server_stats(client: httpx.AsyncClient) -> dict | None:
    """minisgl's GET /stats (preemptions, cached KV pages) when the server has it."""
    import httpx

    try:
        r = await client.get("/stats")
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def model_card(client: httpx.AsyncClient, model: str | None) -> dict:
    """The card of `model` in GET /v1/models (None: the first), {} when there is none."""
    r = await client.get("/v1/models")
    if r.status_code != 200:
        if model is not None:  # a server without /v1/models
            return {}
        raise BenchError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:300]}")
    cards = [c for c in r.json().get("data") or [] if isinstance(c, dict) and "id" in c]
    if model is None and not cards:
        raise BenchError("GET /v1/models lists no model; pass --model")
    return next((c for c in cards if model in (None, c["id"])), {})


async def ask_server(client: httpx.AsyncClient, args: argparse.Namespace) -> None:
    """Fill in args.model (the first model served) and args.vocab_size (prompt ids are drawn
    below it: a tiny model's ids must stay inside its vocabulary) from the server's model
    card when they were not given."""
    if args.model is not None and args.vocab_size is not None:
        return
    card = await model_card(client, args.model)
    args.model = args.model or card["id"]
    if args.vocab_size is None:
        vocab = card.get("vocab_size")  # minisgl's; vLLM and SGLang do not say it
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
            args.vocab_size = vocab
        else:
            args.vocab_size = FALLBACK_VOCAB
            print(
                f"note: the server's /v1/models does not give vocab_size; prompt ids are drawn"
                f" below {FALLBACK_VOCAB} (set --vocab-size for a smaller model)",
                file=sys.stderr,
            )


async def bench(args: argparse.Namespace) -> list[dict]:
    import httpx

    async with http_client(args) as client:
        try:
            await ask_server(client, args)
            model = args.model
            for i in range(args.warmup):  # first-use costs (allocations, JIT) stay out of the data
                prompt = random_tokens(random.Random(-1 - i), 16, args.vocab_size)
                body = request_body(args.endpoint, model, prompt, 8, temperature=0.0)
                body["stream"] = False
                body.pop("stream_options", None)
                path = "/generate" if args.endpoint == "generate" else "/v1/completions"
                r = await client.post(path, json=body)
                if r.status_code != 200:
                    raise BenchError(f"warm-up request: HTTP {r.status_code}: {r.text[:300]}")
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach {args.base_url}: {type(e).__name__}: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BenchError(f"GET /v1/models: unexpected answer ({e!r}); pass --model") from None
        if args.server_pid is not None and args.server_pid == args.launched_pid:
            stats = await server_stats(client) or {}  # --api-server-count: every API process
            args.server_pids = [p["pid"] for p in stats.get("api_servers", [])] or [args.server_pid]
        procs = ClientProcs(args.client_procs, args) if args.client_procs > 1 else None
        try:
            return await run_rates(client, procs, args, model)
        finally:
            if procs is not None:
                procs.close()


async def run_rates(
    client: httpx.AsyncClient, procs: ClientProcs | None, args: argparse.Namespace, model: str
) -> list[dict]:
    summaries = []
    rates = ["trace"] if args.trace else args.rates
    for i, rate in enumerate(rates):
        requests = workload(args, i)
        if args.trace:
            times = [r.arrival for r in requests]
        else:
            times = arrival_times(len(requests), rate, args.seed + 1000 + i)
        desc = f"rate {rate_name(rate)}"
        server_cpu = [process_cpu_s(pid) for pid in args.server_pids]
        results, duration, busy, started_at = await run_rate(
            client, procs, requests, times, args, model, desc
        )
        summary = summarize(results, duration, rate, args.percentiles)
        summary["client_procs"], summary["client_busy"] = args.client_procs, round(busy, 3)
        shares = [
            round((after - before) / max(duration, 1e-9), 3)
            for pid, before in zip(args.server_pids, server_cpu)
            if before is not None and (after := process_cpu_s(pid)) is not None
        ]
        if shares:  # the busiest API process: the one that may hold its streams back
            summary["server_busy"] = max(shares)
        if len(shares) > 1:
            summary["server_busy_each"] = shares
        summary["server_stats"] = await server_stats(client)
        print(summary_line(summary, args.percentiles), flush=True)
        if args.save_detailed:
            summary["started_at"] = round(started_at, 6)
            summary["requests"] = [detail(r) for r in results]
        summaries.append(summary)
    return summaries


def detail(r: Result) -> dict:
    """One request of --save-detailed: when it was sent (s after the rate's start) and its own
    latencies (ms), so that slow tokens can be placed in time."""
    return {
        "sent_s": round(r.sent, 6),
        "ok": r.ok,
        "error": r.error or None,
        "priority": r.priority,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "ttft_ms": round(r.ttft * 1000, 3),
        "itl_ms": [round(x * 1000, 3) for x in r.itl],
        "e2e_ms": round(r.e2e * 1000, 3),
    }


def summary_line(s: dict, percentiles: list[float]) -> str:
    def pcts_of(dist: dict) -> str:
        return "/".join(
            "-" if dist[f"p{p:g}"] is None else f"{dist[f'p{p:g}']:.1f}" for p in percentiles
        )

    def pcts(key: str) -> str:
        return pcts_of(s[key])

    names = "/".join(f"p{p:g}" for p in percentiles)
    lat = "  ".join(f"{label} {pcts(key)}" for key, label in LATENCIES)
    line = (
        f"rate {rate_name(s['rate'])}: {s['completed']} ok, {s['failed']} failed"
        f" in {s['duration_s']:.1f} s; {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s;"
        f" ms {names}: {lat}"
    )
    for value, c in s.get("by_priority", {}).items():
        line += f"\n  priority {value}: {c['completed']} ok, TTFT {names} {pcts_of(c['ttft_ms'])}"
    if s["errors"]:
        line += f"\n  first error: {s['errors'][0]}"
    if s.get("client_busy", 0) > BUSY_CLIENT:
        line += (
            f"\n  warning: a client process was busy {s['client_busy']:.0%} of the run: its own"
            " delays are in these latencies (raise --client-procs)"
        )
    if s.get("server_busy", 0) > BUSY_SERVER:
        line += (
            f"\n  warning: the server process (--server-pid) was busy {s['server_busy']:.0%} of"
            " the run: one core's worth, so it may be what sets these latencies"
        )
    if s["chunkless"]:
        line += (
            f"\n  warning: {s['chunkless']} streams sent nothing before their end (no text to"
            " stream, e.g. a model without a tokenizer?): their TTFT is their e2e latency"
        )
    return line


# ---- plots ---------------------------------------------------------------------------------
def rate_name(rate: float | str) -> str:
    return f"{rate:g}" if isinstance(rate, (int, float)) else rate


def rate_order(rate: float | str) -> tuple[int, float]:
    if isinstance(rate, (int, float)):
        return (0, float(rate))
    return (1, 0.0) if rate == "inf" else (2, 0.0)


def plot(runs: list[dict], path: str) -> None:
    """Latency percentiles vs request rate (one panel per metric) and throughput vs rate; each
    run is a colour, each percentile a line style. Rates sit at even steps (`inf` last)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({s["rate"] for run in runs for s in run["results"]}, key=rate_order)
    pos = {r: i for i, r in enumerate(rates)}
    percentiles = runs[0]["config"]["percentiles"]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), dpi=80)
    for run_idx, run in enumerate(runs):
        color = f"C{run_idx}"
        results = sorted(run["results"], key=lambda s: rate_order(s["rate"]))
        xs = [pos[s["rate"]] for s in results]
        for ax, (key, name) in zip(axes.flat, LATENCIES):
            for i, p in enumerate(percentiles):
                ys = [s[key].get(f"p{p:g}") for s in results]  # None: no data at that rate
                ys = [math.nan if y is None else y for y in ys]
                ax.plot(xs, ys, styles[i % len(styles)], marker="o", ms=3, color=color)
            ax.set_title(f"{name} (ms)")
        for ax, key in zip(axes.flat[4:], ["output_throughput", "request_throughput"]):
            ax.plot(xs, [s[key] for s in results], "-o", ms=3, color=color, label=run["label"])
    axes.flat[4].set_title("output throughput (tok/s)")
    axes.flat[5].set_title("request throughput (req/s)")
    for ax in axes.flat:
        ax.set_xticks(range(len(rates)), [rate_name(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    lines = [
        plt.Line2D([], [], color="k", ls=styles[i % len(styles)], label=f"p{p:g}")
        for i, p in enumerate(percentiles)
    ]
    axes.flat[0].legend(handles=lines, fontsize=8)
    fig.suptitle(" | ".join(dict.fromkeys(run["title"] for run in runs)), fontsize=9)
    if len(runs) > 1:  # one colour per run, named under the panels
        handles, labels = axes.flat[4].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(runs), 3), fontsize=8)
    fig.tight_layout(rect=(0, 0.07 if len(runs) > 1 else 0, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        try:
            with open(p) as f:
                run = json.load(f)
        except (OSError, ValueError) as e:
            raise BenchError(f"{p}: cannot read it ({type(e).__name__}: {e})") from None
        if not isinstance(run, dict) or any(
            k not in run for k in ("label", "title", "config", "results")
        ):
            raise BenchError(f"{p}: not a result of this script")
        runs.append(run)
    return runs


# ---- --launch ------------------------------------------------------------------------------
def launch(command: str, base_url: str, timeout: float, log_path: str) -> subprocess.Popen:
    """Start the server in a session of its own and wait until GET /health answers 200."""
    try:
        with open(log_path, "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                shlex.split(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except (OSError, ValueError) as e:
        raise BenchError(f"--launch: cannot start {command!r}: {e}") from None
    print(f"launched the server (pid {proc.pid}), log {log_path}", file=sys.stderr, flush=True)
    try:  # Ctrl-C while waiting must not leave the server running (it has its own session)
        deadline = time.monotonic() + timeout
        while not healthy(proc, base_url, log_path):
            if time.monotonic() > deadline:
                raise BenchError(f"--launch: {base_url}/health not ready after {timeout:.0f} s")
            time.sleep(0.5)
    except BaseException:
        stop(proc)
        raise
    return proc


def healthy(proc: subprocess.Popen, base_url: str, log_path: str) -> bool:
    import httpx

    if proc.poll() is not None:
        raise BenchError(
            f"--launch: the server exited with code {proc.returncode} before it was ready;"
            f" last lines of {log_path}:\n{tail(log_path)}"
        )
    try:
        return httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (every server handles it; SIGINT may be ignored:
    this script run in the background of a shell starts with it ignored, and so does the
    server), SIGKILL after 60 s and for anything of the group left behind."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# ---- command line --------------------------------------------------------------------------
def host_info() -> dict[str, str]:
    """Date, this checkout's commit and the local GPU, best effort (figures must name them)."""
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    for key, cmd in [
        ("commit", ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "HEAD"]),
        ("gpu", ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]),
    ]:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                info[key] = out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def fraction(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 < x < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value!r}")
    return x


def priority_pair(value: str) -> tuple[int, int]:
    try:
        high, low = (int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers HIGH,LOW, got {value!r}") from None
    if high == low:
        raise argparse.ArgumentTypeError(f"the two classes need different values, got {value!r}")
    return high, low


def positive_rate(value: str) -> list[float]:
    rates = []
    for part in value.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part!r}") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def percentile_list(value: str) -> list[float]:
    try:
        ps = [float(p) for p in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 50,90,99, got {value!r}") from None
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {value!r}")
    return ps


def at_least(lo: int):
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {n}")
        return n

    return parse


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return f"{action.help} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line naming the flag, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=_Formatter, allow_abbrev=False)
    add = p.add_argument
    add("--base-url", help="default: 127.0.0.1 at --launch's --port, else 1919")
    add("--model", help="model name to send; default: the first of GET /v1/models")
    add("--api-key", help="bearer token; default: $OPENAI_API_KEY")
    add("--launch", help="server command: start it, wait for /health, benchmark, stop it")
    add("--launch-timeout", type=float, default=1200.0, help="seconds to wait for /health")
    add("--launch-log", help="the launched server's output; default: a temp file")
    add(
        "--endpoint",
        choices=["completions", "generate"],
        default="completions",
        help="/v1/completions, or SGLang's native /generate with input_ids (through"
        " sglang-router, whose /v1/completions takes text prompts only)",
    )
    _add_workload_args(p)
    _add_output_args(p)
    return _checked(p, p.parse_args(argv))


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument_group("workload").add_argument
    add("--rates", type=positive_rate, help="request rates, e.g. 4,8,inf; default inf")
    add("--num-prompts", type=at_least(1), help="per rate; default 200 (a trace: all)")
    add("--input-len", type=at_least(1), default=512, help="prompt tokens")
    add("--output-len", type=at_least(1), default=256, help="output tokens (ignore_eos)")
    add("--range-ratio", type=float, default=0.0, help="random lengths in len * (1 +- r)")
    add("--shared-prefix", action="store_true", help="groups of requests share a prefix")
    add("--num-groups", type=at_least(1), default=8, help="shared prefixes")
    add("--prefix-len", type=at_least(1), default=2000, help="tokens of each prefix")
    add("--suffix-len", type=at_least(1), default=100, help="tokens of each request's own")
    add("--trace", help="JSONL: timestamp, input_length, output_length[, hash_ids]")
    add("--trace-time-unit", choices=["s", "ms"], default="s", help="ms: Mooncake")
    add("--trace-time-scale", type=float, default=1.0, help="times the gaps (0.5: 2x rate)")
    add("--trace-block-size", type=at_least(1), default=16, help="prompt tokens per hash id")
    add(
        "--vocab-size",
        type=at_least(1),
        help="prompt ids are drawn below it; default: the vocab_size of the server's model card"
        f" (minisgl gives it), else {FALLBACK_VOCAB}",
    )
    add("--seed", type=int, default=0, help="of prompts and arrivals (one per run: see above)")
    add("--temperature", type=float, default=0.0, help="sampling temperature")
    add(
        "--priority-mix",
        type=fraction,
        metavar="FRACTION",
        help="this fraction of each rate's requests (drawn at random) is sent with the high "
        "priority of --priority-values, the rest with the low one; the summary splits the "
        "latencies by class",
    )
    add(
        "--priority-values",
        type=priority_pair,
        default=(-1, 0),
        metavar="HIGH,LOW",
        help="the `priority` sent to each class (minisgl and vLLM serve lower values first; "
        "SGLang by default higher ones: give 1,0 there)",
    )
    add("--max-concurrency", type=at_least(1), help="cap on requests in flight")
    add(
        "--client-procs",
        type=at_least(1),
        help="client processes that share each rate's requests; default: half the CPUs"
        " (at most 8), 1 with --max-concurrency (one cap needs one event loop). A process"
        " streams ~20,000 events/s at most; the summary warns when one was saturated",
    )
    add(
        "--server-pid",
        type=at_least(1),
        help="the server process whose CPU share of each rate to report (`server_busy`; a"
        " minisgl server's main process is its API server); default: --launch's process, or"
        " with --api-server-count every API process (the busiest; `server_busy_each`)",
    )
    add("--warmup", type=at_least(0), default=1, help="short requests before measuring")
    add("--timeout", type=float, default=600.0, help="seconds a request may wait for a chunk")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument_group("output").add_argument
    add("--out", help="JSON result file")
    add("--plot", help="PNG plot file")
    add("--json", help="append one JSON line per rate (host, commit, command, figures) to it")
    add(
        "--save-detailed",
        action="store_true",
        help="--out also holds every request: when it was sent, its TTFT, each ITL, its E2E",
    )
    add("--note", help="a remark stored in each --json line (e.g. the server's flags)")
    add("--label", help="this run's name in plots; default: the workload")
    add("--percentiles", type=percentile_list, default=[50.0, 90.0, 99.0], help="e.g. 50,99")
    add("--plot-only", nargs="+", metavar="JSON", help="only plot these results into --plot")
    add("--disable-tqdm", action="store_true", help="no progress bar")


def _checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The flags' combinations checked (an error names them), and the defaults that depend
    on other flags filled in."""
    if args.plot_only and not args.plot:
        p.error("--plot-only needs --plot")
    if args.save_detailed and not args.out:
        p.error("--save-detailed needs --out (the requests go into that file)")
    if args.server_pid is not None and process_cpu_s(args.server_pid) is None:
        p.error(f"--server-pid {args.server_pid}: no such process (or no /proc to read it from)")
    if args.shared_prefix and args.trace:
        p.error("--shared-prefix and --trace exclude each other")
    if args.trace and args.rates is not None:
        p.error("--rates does not apply to --trace (arrivals come from the trace)")
    args.rates = args.rates or [math.inf]
    args.launched_pid = None  # set by --launch
    args.server_pids = [args.server_pid] if args.server_pid else []
    if args.client_procs is None:
        args.client_procs = 1 if args.max_concurrency else min(8, max(1, cpu_count() // 2))
    elif args.client_procs > 1 and args.max_concurrency:
        p.error("--max-concurrency needs --client-procs 1 (one cap needs one event loop)")
    if not 0 <= args.range_ratio < 1:
        p.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if not args.trace_time_scale > 0 or not args.timeout > 0:
        p.error("--trace-time-scale and --timeout must be > 0")
    try:
        words = shlex.split(args.launch or "")
    except ValueError as e:
        p.error(f"argument --launch: {e}")
    if args.base_url is None:
        port = words[words.index("--port") + 1] if "--port" in words[:-1] else "1919"
        args.base_url = f"http://127.0.0.1:{port}"
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    return args


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) that process `pid` has used; None off Linux or once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_count() -> int:
    """The CPUs this process may run on (a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def append_lines(path: str, run: dict, note: str | None) -> None:
    """One line per rate in results.jsonl's style: where, when, what ran, and the figures."""
    head = {
        "gpu": run["host"].get("gpu", "none"),
        "date": run["host"]["date"][:10],
        "commit": run["host"].get("commit", "unknown")[:7],
        "bench": "serving",
        "model": run["config"]["model"],
        "label": run["label"],
        "workload": run["title"].split(" | ", 1)[-1],
        **({"note": note} if note else {}),
        "command": run["command"],
    }
    keep = ["rate", "completed", "failed", "request_throughput", "output_throughput"]
    keep += ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "by_priority", "client_procs", "client_busy"]
    keep += ["server_busy", "server_busy_each"]
    try:
        with open(path, "a") as f:
            for summary in run["results"]:
                figures = {k: summary[k] for k in keep if k in summary}
                f.write(json.dumps({**head, **figures}) + "\n")
    except OSError as e:
        raise BenchError(f"cannot append to {path}: {e}") from None


def require(*modules: str) -> None:
    """BenchError naming the bench extra when one of `modules` cannot be imported."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        names = " and ".join([", ".join(missing[:-1]), missing[-1]] if missing[:-1] else missing)
        raise BenchError(f"this needs {names}, not installed: {BENCH_EXTRA}")


def workload_title(args: argparse.Namespace) -> str:
    title = base_title(args)
    if args.priority_mix is not None:
        high, low = args.priority_values
        title += f", {args.priority_mix:.0%} priority {high} (others {low})"
    return title


def base_title(args: argparse.Namespace) -> str:
    if args.trace:
        return f"trace {os.path.basename(args.trace)} x{args.trace_time_scale:g}"
    n = args.num_prompts or 200
    if args.shared_prefix:
        return (
            f"shared prefix: {n} req, {args.num_groups} groups x {args.prefix_len} prefix"
            f" + {args.suffix_len} suffix -> {args.output_len} out"
        )
    spread = f" +-{args.range_ratio:.0%}" if args.range_ratio else ""
    return f"random: {n} req, {args.input_len} in -> {args.output_len} out{spread}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        require(*([] if args.plot_only else RUN_MODULES), *(["matplotlib"] if args.plot else []))
        if args.plot_only:
            plot(load_runs(args.plot_only), args.plot)
            print(f"wrote {args.plot}")
            return 0
        server = None
        if args.launch:
            log = args.launch_log or os.path.join(
                tempfile.gettempdir(), f"bench_serving_server_{os.getpid()}.log"
            )
            server = launch(args.launch, args.base_url, args.launch_timeout, log)
            args.launched_pid = server.pid
            args.server_pid = args.server_pid or server.pid
        try:
            summaries = asyncio.run(bench(args))
        finally:
            if server is not None:
                stop(server)
        title = f"{args.model} | {workload_title(args)}"
        config = {
            k: v if not isinstance(v, float) or math.isfinite(v) else "inf"
            for k, v in vars(args).items()
            if k not in ("api_key", "plot_only", "disable_tqdm")
        }
        config["rates"] = [s["rate"] for s in summaries]
        run = {
            "label": args.label or workload_title(args),
            "title": title,
            "config": config,
            "host": host_info(),
            "command": shlex.join(["python", "benchmark/online/bench_serving.py", *argv]),
            "results": summaries,
        }
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(run, f, indent=1)
            print(f"wrote {args.out}")
        if args.json:
            append_lines(args.json, run, args.note)
            print(f"appended {len(summaries)} lines to {args.json}")
        if args.plot:
            plot([run], args.plot)
            print(f"wrote {args.plot}")
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if all(s["completed"] > 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
