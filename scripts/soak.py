"""Soak a running minisgl server: for a bounded time, a fixed number of clients send a mix of
good requests (checked), bad ones (must get a 4xx) and ones that leave mid-way (streamed or
not). At the end, once the server is idle, print what was done, errors by kind, KV pages leaked
(must be 0), prefix-cache locks held (must be 0) and the growth of the server's resident memory
(all its processes) since the warm-up.

    python scripts/soak.py --url http://127.0.0.1:1919 --duration 600

Exit code 0 when nothing leaked and every error was an expected one; 1 otherwise. Only send it
to a server of your own: it is a load generator."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx

KINDS = {  # kind: weight
    "stream": 30,
    "plain": 20,
    "chat": 10,
    "generate": 10,
    "bad": 15,
    "leave_stream": 10,
    "leave_plain": 5,
}
BAD_BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [1, -2]}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "top_p": 7, "stream": True}),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/generate", {"input_ids": [1], "text": "both"}),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}),
]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = args.url.rstrip("/")
        self.headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.done: Counter[str] = Counter()  # requests finished, by kind
        self.errors: Counter[str] = Counter()  # unexpected outcomes, by kind
        self.expected: Counter[str] = Counter()  # refusals that are the server doing its job
        self.rng = random.Random(args.seed)
        self.leave_tokens, self.leave_seconds = 512, 1.0  # calibrate_leave's

    # ---- one request of each kind ------------------------------------------------------
    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, 250) for _ in range(self.rng.randint(4, 64))]

    def check_status(self, kind: str, r: httpx.Response) -> bool:
        if r.status_code == 200:
            return True
        if r.status_code == 503 and "overloaded" in r.text:  # --max-queued-requests at work
            self.expected["503 overloaded"] += 1
        else:
            self.errors[f"{kind}: HTTP {r.status_code}"] += 1
        return False

    async def stream(self, client: httpx.AsyncClient, leave: bool) -> None:
        kind = "leave_stream" if leave else "stream"
        n = self.rng.randint(4, 32)
        body = {
            "prompt": self.prompt(),
            "max_tokens": 512 if leave else n,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        leave_after = self.rng.randint(1, 8)
        async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            if not self.check_status(kind, r):
                await r.aread()
                return
            chunks, usage, finished = 0, None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    self.errors[f"{kind}: stream error {data['error'].get('code')}"] += 1
                    return
                usage = data.get("usage") or usage
                chunks += 1
                if leave and chunks == leave_after:
                    self.done[kind] += 1
                    return  # closing the connection mid-stream
        if leave or not finished or usage is None or usage["completion_tokens"] != n:
            self.errors[f"{kind}: bad answer"] += 1
        else:
            self.done[kind] += 1

    async def plain(self, client: httpx.AsyncClient, kind: str) -> None:
        n = self.rng.randint(4, 32)
        if kind == "chat":
            path, key = "/v1/chat/completions", "completion_tokens"
            words = " ".join(
                self.rng.choice(["the", "cat", "runs", "fast", "hello"]) for _ in range(8)
            )
            body: dict[str, Any] = {"messages": [{"role": "user", "content": words}]}
            body |= {"max_tokens": n, "ignore_eos": True, "temperature": 0.7}
        elif kind == "generate":
            path, key = "/generate", "completion_tokens"
            body = {
                "input_ids": self.prompt(),
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
            }
        else:
            path, key = "/v1/completions", "completion_tokens"
            body = {"prompt": self.prompt(), "max_tokens": n, "ignore_eos": True}
        r = await client.post(f"{self.url}{path}", json=body)
        if self.check_status(kind, r):
            got = r.json()["usage"][key] if kind != "generate" else r.json()[key]
            if got == n:
                self.done[kind] += 1
            else:
                self.errors[f"{kind}: bad answer"] += 1

    async def calibrate_leave(self, client: httpx.AsyncClient) -> None:
        """Time one answer of up to 512 tokens alone on the server: the clients that leave
        give up at a fraction of it, on an answer up to 8x as long, so that they leave before
        the answer on any hardware (a fixed delay would not: a fast server answers first)."""
        model = (await client.get(f"{self.url}/v1/models")).json()["data"][0]
        room = model.get("max_model_len", 576) - 64  # for the longest prompt()
        timed = min(512, room)
        # The leaving clients ask for 8x the timed answer where the context allows: a busy
        # moment during the calibration (CI) then cannot make them leave after their answer.
        self.leave_tokens = min(8 * timed, room)
        body = {"prompt": [5] * 64, "max_tokens": timed, "ignore_eos": True}
        times = []
        # the fastest of --calibrate-runs (3): one slow run (a busy machine) overstates it
        for _ in range(self.args.calibrate_runs):
            start = time.monotonic()
            r = await client.post(f"{self.url}/v1/completions", json=body)
            r.raise_for_status()
            times.append(time.monotonic() - start)
        self.leave_seconds = min(times)
        print(f"one {timed}-token answer alone: {self.leave_seconds:.2f} s", flush=True)

    async def leave_plain(self, client: httpx.AsyncClient) -> None:
        body = {"prompt": self.prompt(), "max_tokens": self.leave_tokens, "ignore_eos": True}
        try:  # gives up long before the answer: the server must abort the request
            timeout = self.leave_seconds * self.rng.uniform(0.05, 0.3)
            r = await client.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
        except httpx.TimeoutException:
            self.done["leave_plain"] += 1
            return
        if self.check_status("leave_plain", r):
            self.errors["leave_plain: answered before the client left"] += 1

    async def bad(self, client: httpx.AsyncClient) -> None:
        path, body = self.rng.choice(BAD_BODIES)
        if isinstance(body, bytes):
            r = await client.post(
                f"{self.url}{path}", content=body, headers={"content-type": "application/json"}
            )
        else:
            r = await client.post(f"{self.url}{path}", json=body)
        if 400 <= r.status_code < 500 and "error" in r.json():
            self.done["bad"] += 1
        else:
            self.errors[f"bad: HTTP {r.status_code}"] += 1

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        try:
            if kind in ("stream", "leave_stream"):
                await self.stream(client, leave=kind == "leave_stream")
            elif kind == "leave_plain":
                await self.leave_plain(client)
            elif kind == "bad":
                await self.bad(client)
            else:
                await self.plain(client, kind)
        except httpx.HTTPError as e:
            self.errors[f"{kind}: {type(e).__name__}"] += 1

    # ---- the run -----------------------------------------------------------------------
    async def stats(self, client: httpx.AsyncClient) -> dict[str, Any]:
        return (await client.get(f"{self.url}/stats")).json()

    async def wait_idle(self, client: httpx.AsyncClient, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            s = await self.stats(client)
            if s["running"] == s["waiting"] == s["in_flight"] == 0 or time.monotonic() > deadline:
                return s
            await asyncio.sleep(0.5)

    async def run(self) -> int:
        a = self.args
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=a.concurrency)
        async with httpx.AsyncClient(headers=self.headers, timeout=300, limits=limits) as client:
            await self.calibrate_leave(client)
            start = time.monotonic()
            deadline = start + a.duration
            warm_until = start + min(a.warmup, a.duration / 2)
            rss: dict[str, int] = {"start": (await self.stats(client))["rss_bytes"]}

            async def worker() -> None:
                while time.monotonic() < deadline:
                    await self.one(client)

            async def monitor() -> None:
                while time.monotonic() < deadline:
                    await asyncio.sleep(min(a.report_every, max(0.0, deadline - time.monotonic())))
                    if "warm" not in rss and time.monotonic() >= warm_until:
                        rss["warm"] = (await self.stats(client))["rss_bytes"]
                    s = await self.stats(client)
                    print(
                        f"[{time.monotonic() - start:6.0f} s] done {sum(self.done.values())}, "
                        f"errors {sum(self.errors.values())}, running {s['running']}, "
                        f"rss {s['rss_bytes'] / 2**20:.0f} MiB",
                        flush=True,
                    )

            await asyncio.gather(monitor(), *(worker() for _ in range(a.concurrency)))
            elapsed = time.monotonic() - start
            final = await self.wait_idle(client)
        rss.setdefault("warm", rss["start"])
        leaked, locked = final["leaked_pages"], final["locked_pages"]
        idle = final["running"] == final["waiting"] == final["in_flight"] == 0
        growth = (final["rss_bytes"] - rss["warm"]) / 2**20
        print(f"\nsoak: {elapsed:.0f} s, {a.concurrency} clients against {self.url}")
        print(f"requests done: {sum(self.done.values())} ({dict(sorted(self.done.items()))})")
        print(f"expected refusals: {dict(self.expected) or 'none'}")
        print(f"errors by kind: {dict(sorted(self.errors.items())) or 'none'}")
        print(f"server idle afterwards: {idle}")
        print(f"pages leaked: {leaked} (locked prefix-cache pages: {locked})")
        print(
            f"RSS: {rss['start'] / 2**20:.0f} MiB at start, {rss['warm'] / 2**20:.0f} MiB after "
            f"warm-up, {final['rss_bytes'] / 2**20:.0f} MiB at the end ({growth:+.1f} MiB)"
        )
        ok = idle and leaked == 0 and locked == 0 and not self.errors
        print("soak: OK" if ok else "soak: FAILED")
        return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:1919")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16, help="clients at once")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds before the RSS baseline")
    p.add_argument(
        "--report-every", type=float, default=30.0, help="seconds between progress lines"
    )
    p.add_argument(
        "--calibrate-runs",
        type=int,
        default=3,
        help="times a 512-token answer is timed alone before the load (the fastest counts):"
        " leaving clients give up at 5-30%% of it, on answers 8x as long",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.duration <= 0 or args.concurrency < 1 or args.calibrate_runs < 1:
        p.error("--duration must be > 0, --concurrency and --calibrate-runs >= 1")
    return asyncio.run(Soak(args).run())


if __name__ == "__main__":
    raise SystemExit(main())
