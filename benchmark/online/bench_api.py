"""The API server process alone: how many streamed tokens per second it delivers, and at what
CPU cost per token, when the engine behind it is as fast as a GPU's.

A stand-in pipeline process takes the place of the tokenizer, scheduler and detokenizer: every
--step-ms it sends each running request's next token (one BatchMsg per step, as the
detokenizer does). The real API server (minisgl's app under uvicorn, as `python -m minisgl`
runs it) streams them to --streams raw-socket clients in this process, which only count the
events they receive. On an H100, 200 streams of Qwen3-0.6B take ~10 ms per step (~20,000
tokens/s); a server whose API process cannot keep up delays every stream (issue 22's ITL).

    python benchmark/online/bench_api.py --streams 200 --tokens 256 --step-ms 10 [--api-server-count 2]

Reports the offered and delivered tokens/s, the gaps between the events a client receives
(p50/p90/p99: events that arrive in one read count as gaps of 0) and the API process's CPU
time per 1,000 tokens."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from typing import Any

from bench_serving import percentile, process_cpu_s  # this script's directory is on sys.path

EVENT = b'data: {"id"'  # the start of every completion chunk


def run_pipeline(tok_addr: str, api_addrs: list[str], step_s: float) -> None:
    """The tokenizer, scheduler and detokenizer, faked: one token per running request per step,
    routed to the API process that took the request (as the detokenizer does)."""
    from minisgl.message import AbortMsg, BatchMsg, TokenizeMsg, UserReply
    from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

    pull = ZmqPullQueue(tok_addr, create=True)
    if len(api_addrs) > 1:  # the serving extension's routing of the replies
        from minisgl.ext.serving.apis import ApiQueues

        to_api: Any = ApiQueues.connect(api_addrs)
    else:
        to_api = ZmqPushQueue(api_addrs[0], create=False)
    active: dict[int, list[int]] = {}  # uid -> [tokens made, max_tokens, prompt tokens]
    tick = time.monotonic()
    while True:
        while (msg := pull.get_nowait()) is not None:
            if isinstance(msg, TokenizeMsg):
                active[msg.uid] = [0, msg.params.max_tokens, len(msg.input_ids or [])]
            elif isinstance(msg, AbortMsg):
                active.pop(msg.uid, None)
        tick = max(tick + step_s, time.monotonic() - step_s)  # behind: no burst to catch up
        time.sleep(max(0.0, tick - time.monotonic()))
        replies = []
        for uid, state in list(active.items()):
            state[0] += 1
            done = state[0] >= state[1]
            replies.append(
                UserReply(uid, " x", [7], done, "length" if done else None, state[2], state[0])
            )
            if done:
                del active[uid]
        if replies:
            to_api.put(BatchMsg(replies))


def run_api(tok_addr: str, api_addrs: list[str], rank: int, port: int, fd: int | None) -> None:
    """API process `rank` of minisgl's server, as `python -m minisgl --api-server-count
    len(api_addrs)` runs it, behind the stand-in pipeline; `fd`: its socket of the port (with
    more than one; else uvicorn binds the port)."""
    from minisgl.server.args import ServerArgs
    from minisgl.server.frontend import Frontend
    from minisgl.server.launch import http_server

    args = ServerArgs()
    args.host, args.port, args.log_level = "127.0.0.1", port, "warning"
    try:  # the server's: the serving extension's routes (/stats...) read its views
        from minisgl.ext.serving.frontend import ServingFrontend

        frontend: Frontend = ServingFrontend(
            [tok_addr], api_addrs[rank], api_rank=rank, api_addrs=api_addrs
        )
    except ModuleNotFoundError:  # the core alone: one API process
        frontend = Frontend([tok_addr], api_addrs[0])
    server = http_server(args, {"max_seq_len": 1 << 20}, frontend)
    server.run(sockets=None if fd is None else [socket.socket(fileno=fd)])


async def one_stream(port: int, tokens: int) -> tuple[float, list[tuple[float, int]]]:
    """Send time and (time, events) of each read that brought events."""
    body = json.dumps(
        {"prompt": [1, 2, 3], "max_tokens": tokens, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = time.perf_counter()
    writer.write(head.encode() + body)
    arrivals: list[tuple[float, int]] = []
    tail = b""  # shorter than EVENT: no event is counted twice
    while data := await reader.read(1 << 16):
        now, chunk = time.perf_counter(), tail + data
        if n := chunk.count(EVENT):
            arrivals.append((now, n))
        tail = chunk[-(len(EVENT) - 1) :]
    writer.close()
    return sent, arrivals


def summarize(results: list[tuple[float, list[tuple[float, int]]]]) -> dict[str, float]:
    gaps: list[float] = []
    total = 0
    for _, arrivals in results:
        for (before, _), (at, n) in zip(arrivals, arrivals[1:]):
            gaps += [at - before] + [0.0] * (n - 1)
        total += sum(n for _, n in arrivals)
    start = min(sent for sent, _ in results)
    end = max(arrivals[-1][0] for _, arrivals in results if arrivals)
    reads = sum(len(arrivals) for _, arrivals in results)
    out = {"tokens": total, "seconds": end - start, "tok_per_s": total / (end - start)}
    out["events_per_read"] = total / max(1, reads)
    ordered = sorted(gaps) or [0.0]
    for q in (50, 90, 99):
        out[f"gap_p{q}_ms"] = percentile(ordered, q) * 1e3
    return out


async def burst(port: int, streams: int, tokens: int) -> list[tuple[float, list[Any]]]:
    return list(await asyncio.gather(*(one_stream(port, tokens) for _ in range(streams))))


def wait_ready(port: int, procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """Until /stats answers, which takes every API process (each answers the one asked)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            sys.exit("bench_api: an API process exited")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10)
            return
        except OSError:
            time.sleep(0.2)
    sys.exit(f"bench_api: the API server did not answer in {timeout:.0f} s")


def start_apis(me: list[str], port: int, count: int) -> list[subprocess.Popen]:
    """The API processes; with more than one, each gets its socket of the port as the
    launcher opens them (`reuse_port_sockets`: one per process, SO_REUSEPORT)."""
    socks = []
    if count > 1:  # the serving extension's
        from minisgl.ext.serving.scale import reuse_port_sockets

        socks = reuse_port_sockets("127.0.0.1", port, count)
    procs = []
    for k in range(count):
        cmd = [*me, "--role", "api", "--rank", str(k), "--port", str(port)]
        fds = [socks[k].fileno()] if socks else []
        procs.append(subprocess.Popen(cmd + [f"--fd={f}" for f in fds], pass_fds=fds))
    for sock in socks:  # the processes hold them now
        sock.close()
    return procs


def cpu_s(procs: list[subprocess.Popen]) -> list[float]:
    times = [process_cpu_s(proc.pid) for proc in procs]
    if any(t is None for t in times):
        sys.exit("bench_api: cannot read the API processes' CPU time (Linux /proc only)")
    return times  # type: ignore[return-value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200, help="streams started at once")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=10.0, help="one token per stream per step")
    p.add_argument("--port", type=int, default=0, help="the API server's (0: a free one)")
    p.add_argument(
        "--api-server-count", type=int, default=1, help="API processes (the server's flag)"
    )
    p.add_argument("--json", help="append the result as one JSON line to this file")
    p.add_argument("--note", default="", help="stored with --json")
    p.add_argument("--role", choices=["api", "pipeline"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--addrs", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "pipeline":
        return run_pipeline(args.addrs[0], args.addrs[1:], args.step_ms / 1e3)
    if args.role == "api":
        return run_api(args.addrs[0], args.addrs[1:], args.rank, args.port, args.fd)
    if args.api_server_count < 1:
        p.error("--api-server-count must be at least 1")

    if args.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="bench_api_")
    apis = [f"ipc://{folder}/api{k}" for k in range(args.api_server_count)]
    me = [sys.executable, os.path.abspath(__file__), "--addrs", f"ipc://{folder}/tok", *apis]
    pipeline = subprocess.Popen([*me, "--role", "pipeline", "--step-ms", str(args.step_ms)])
    procs = start_apis(me, args.port, args.api_server_count)
    try:
        wait_ready(args.port, procs)
        asyncio.run(burst(args.port, min(16, args.streams), 16))  # warm-up
        cpu = cpu_s(procs)
        result = summarize(asyncio.run(burst(args.port, args.streams, args.tokens)))
        used = [after - before for before, after in zip(cpu, cpu_s(procs))]
        api_ms_per_1k = sum(used) * 1e6 / result["tokens"]
        busiest = max(used) / result["seconds"]
    finally:
        for proc in (*procs, pipeline):
            proc.terminate()
            proc.wait(10)
    offered = args.streams / args.step_ms * 1e3
    print(
        f"{args.streams} streams x {args.tokens} tokens, a step every {args.step_ms:g} ms "
        f"(offered {offered:,.0f} tok/s): delivered {result['tok_per_s']:,.0f} tok/s; "
        f"gaps p50/p90/p99 {result['gap_p50_ms']:.1f}/{result['gap_p90_ms']:.1f}/"
        f"{result['gap_p99_ms']:.1f} ms; {result['events_per_read']:.2f} events per read; "
        f"API CPU {api_ms_per_1k:.1f} ms per 1,000 tokens ({args.api_server_count} processes, "
        f"the busiest {busiest:.0%} of a core)"
    )
    if args.json:
        line = {
            "bench": "bench_api",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "streams": args.streams,
            "tokens": args.tokens,
            "step_ms": args.step_ms,
            "offered_tok_per_s": offered,
            "api_server_count": args.api_server_count,
            "api_cpu_ms_per_1k_tokens": api_ms_per_1k,
            "api_busiest_share": busiest,
            "note": args.note,
        } | result
        with open(args.json, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
