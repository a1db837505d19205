"""The api server's side of the pipeline: submit requests to the tokenizer workers and route
the replies coming back from the detokenizer to one asyncio queue per request. It also shows
every reply to its `metrics` (the `request_observer` point: counts nothing without the serving
extension), fails every request when the pipeline dies, keeps each --dp replica's stats apart
and, with --dp > 1, tells the tokenizer worker when a request ends (its dispatcher counts the
replicas' loads). API process k of N numbers its requests k, k + N, k + 2N... (the pipeline
routes their replies back by uid % N). The serving extension's Frontend
(`ext/serving/frontend.py`) adds the watchdog, /flush_cache and the API processes' views of
each other."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, fields
from typing import Any

from minisgl.extension import RequestObserver, extensions
from minisgl.message import (
    AbortMsg,
    ApiViewMsg,
    BatchFrontendMsg,
    DoneMsg,
    SchedulerStats,
    TokenizeMsg,
    UserReply,
    encode,
)
from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue

logger = logging.getLogger(__name__)


def total_stats(replicas: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' snapshots summed (one replica: its own)."""
    if len(replicas) == 1:
        return replicas[0]
    names = [f.name for f in fields(SchedulerStats) if f.name not in ("dp_rank", "counts")]
    counts = {k: sum(r.counts.get(k, 0) for r in replicas) for r0 in replicas for k in r0.counts}
    return SchedulerStats(**{n: sum(getattr(r, n) for r in replicas) for n in names}, counts=counts)


def tree_rss_bytes() -> int:
    """Resident memory of this process and its children (the server's workers); 0 off Linux."""
    total = 0
    for pid in [os.getpid(), *(p.pid for p in mp.active_children())]:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
    return total


@dataclass
class _InFlight:
    queue: asyncio.Queue[UserReply] = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    last_token: float | None = None  # None until the first token: the request is queued
    priority: int = 0  # (its metrics label)
    finished: bool = False  # its last reply came (the handler may not have collected it yet)


class Frontend:
    def __init__(
        self,
        tokenizer_addrs: list[str],
        recv_addr: str,
        scheduler_addrs: list[str] | None = None,
        api_rank: int = 0,
        api_count: int = 1,
    ) -> None:
        """`scheduler_addrs`: one per --dp replica; `api_rank` of `api_count` API processes."""
        self.to_tokenizers = [ZmqAsyncPushQueue(a, create=False) for a in tokenizer_addrs]
        self.recv = ZmqAsyncPullQueue(recv_addr, create=True)
        self.scheduler_addrs = scheduler_addrs or []
        self.api_rank, self.api_count = api_rank, api_count
        self.requests: dict[int, _InFlight] = {}
        self.uids = itertools.count(api_rank, self.api_count)
        self.replica_stats = [SchedulerStats(dp_rank=r) for r in range(self.num_replicas)]
        # the server's RSS is rank 0's to count (its children include the other API processes)
        self.rss: Callable[[], int] = tree_rss_bytes if api_rank == 0 else lambda: 0
        observer = extensions().request_observer
        self.metrics = RequestObserver() if observer is None else observer(self)
        self.dead: str | None = None  # set when the pipeline can no longer answer
        self.last_progress = time.monotonic()  # of the last message, or of the last idle tick
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks.append(self._loop.create_task(self._dispatch()))

    @property
    def num_replicas(self) -> int:
        return max(1, len(self.scheduler_addrs))

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler snapshot, summed over the replicas."""
        return total_stats(self.replica_stats)

    @property
    def num_queued(self) -> int:
        """Requests submitted that have not produced a token yet."""
        return sum(r.last_token is None for r in self.requests.values())

    @property
    def num_unfinished(self) -> int:
        """Requests in flight whose last reply has not come: the pipeline owes them answers."""
        return sum(not r.finished for r in self.requests.values())

    async def _dispatch(self) -> None:
        while True:
            batch = await self.recv.get()
            self.last_progress = time.monotonic()
            if not isinstance(batch, BatchFrontendMsg):
                if not await self.received(batch):  # decoded, but not for here
                    logger.error("api server: dropped an unexpected %s", type(batch).__name__)
                continue
            stats = batch.stats
            if stats is not None and 0 <= stats.dp_rank < len(self.replica_stats):
                self.replica_stats[stats.dp_rank] = stats
            now = time.monotonic()
            for reply in batch.msgs:
                req = self.requests.get(reply.uid)
                if req is not None:
                    self._observe(req, reply, now)
                    req.queue.put_nowait(reply)

    async def received(self, msg: Any) -> bool:
        """A message other than replies (the serving extension's: /flush_cache's answers, the
        other API processes'); False: not one this Frontend expects."""
        return False

    def view(self, seq: int = 0, metrics: bool = False) -> ApiViewMsg:
        """What this API process counts: requests in flight, not started yet (and with
        `metrics` the text of its metrics)."""
        text = self.metrics.text() if metrics else ""
        return ApiViewMsg(
            self.api_rank, seq, os.getpid(), len(self.requests), self.num_queued, text, self.rss()
        )

    async def views(self, metrics: bool = False) -> list[ApiViewMsg]:
        """Every API process's view, by rank: this one's (the serving extension's Frontend asks
        the others too)."""
        return [self.view(0, metrics)]

    def _observe(self, req: _InFlight, reply: UserReply, now: float) -> None:
        self.metrics.reply(req.priority, req.submitted, req.last_token, reply, now)
        if reply.token_ids:
            req.last_token = now
        if reply.finished:
            req.finished = True

    def new_uid(self) -> int:
        return next(self.uids)

    def _tokenizer(self, uid: int) -> ZmqAsyncPushQueue:
        return self.to_tokenizers[uid % len(self.to_tokenizers)]

    async def submit(self, msg: TokenizeMsg) -> asyncio.Queue[UserReply]:
        """Hand a request to its tokenizer worker; only then does it count as in flight (and
        against --max-queued-requests): a message that cannot be encoded takes nothing."""
        data = encode(msg)
        req = self.requests[msg.uid] = _InFlight(priority=msg.params.priority)
        try:
            await self._tokenizer(msg.uid).put_encoded(data)
        except BaseException:
            self.requests.pop(msg.uid, None)
            raise
        return req.queue

    async def abort(self, uid: int, reason: str = "abort") -> None:
        if self.requests.pop(uid, None) is not None:
            self.metrics.ended(reason)
            await self._tokenizer(uid).put(AbortMsg(uid))

    async def stream(
        self, msg: TokenizeMsg, timeout: float | None = None
    ) -> AsyncGenerator[UserReply, None]:
        """Replies of one request until it finishes (see `batches`)."""
        async with aclosing(self.batches(msg, timeout)) as batches:
            async for batch in batches:
                for reply in batch:
                    yield reply

    async def batches(
        self, msg: TokenizeMsg, timeout: float | None = None
    ) -> AsyncGenerator[list[UserReply], None]:
        """Replies of one request until it finishes, each time all that have come: a handler
        that fell behind catches up in one write instead of one per reply. Leaving early
        (client gone) aborts the request; past `timeout` seconds it ends with a "timeout"
        reply and is aborted."""
        queue = await self.submit(msg)
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = timed_out = False
        try:
            while not finished:
                if deadline is None:
                    reply = await queue.get()
                else:
                    try:
                        reply = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
                    except asyncio.TimeoutError:
                        timed_out = True
                        error = f"request timed out after {timeout:g} s"
                        yield [UserReply(msg.uid, "", [], True, "timeout", 0, 0, error)]
                        return  # not `finished`: the request is aborted below
                batch = [reply]
                while not reply.finished and not queue.empty():
                    reply = queue.get_nowait()
                    batch.append(reply)
                finished = reply.finished
                yield batch
        finally:
            if finished:
                self.requests.pop(msg.uid, None)
                if self.num_replicas > 1:  # the dispatcher's load count
                    await asyncio.shield(self._tokenizer(msg.uid).put(DoneMsg(msg.uid)))
            else:
                await asyncio.shield(self.abort(msg.uid, "timeout" if timed_out else "abort"))

    def fail(self, reason: str) -> None:
        """The pipeline is gone: end every request with an error; refuse new ones from now on."""
        if self.dead is not None:
            return
        self.dead = reason
        for uid, req in self.requests.items():
            reply = UserReply(uid, "", [], True, "error", 0, 0, reason)
            self._observe(req, reply, time.monotonic())
            req.queue.put_nowait(reply)

    def fail_threadsafe(self, reason: str) -> None:
        if self._loop is None or self._loop.is_closed():
            self.dead = reason
        else:
            self._loop.call_soon_threadsafe(self.fail, reason)
