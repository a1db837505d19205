"""The api server's side of the pipeline: submit requests to the tokenizer workers and route
the replies coming back from the detokenizer to one asyncio queue per request. It also shows
every reply to its `metrics` (the `request_observer` point: counts nothing without the serving
extension), fails every request when the pipeline dies, and
runs the watchdog: while a request is unfinished, some message must come back from the pipeline
at least every --watchdog-timeout seconds (the scheduler sends its stats every 0.2 s while it has
work), or the pipeline is taken for hung. It keeps each --dp replica's stats apart, sends
/flush_cache to every replica's scheduler and, with --dp > 1, tells the tokenizer worker when a
request ends (its dispatcher counts the replicas' loads).

With --api-server-count N, each API process has a Frontend of its own (`api_rank` k): it numbers
its requests k, k + N, k + 2N... (the pipeline routes their replies back by uid % N), asks the
others for their views (`views`: /stats and /metrics add them up), and passes a failure on
(`ApiFailMsg`: rank 0's launcher fails the server; the others fail their own requests)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, fields

from minisgl.extension import RequestObserver, extensions
from minisgl.message import (
    AbortMsg,
    ApiFailMsg,
    ApiQueryMsg,
    ApiViewMsg,
    BatchFrontendMsg,
    DoneMsg,
    FlushCacheMsg,
    FlushCacheReply,
    SchedulerStats,
    TokenizeMsg,
    UserReply,
    encode,
)
from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue

logger = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 10.0  # for every replica's answer to /flush_cache
VIEW_TIMEOUT_S = 5.0  # for the other API processes' views (/stats, /metrics)


def total_stats(replicas: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' snapshots summed (one replica: its own)."""
    if len(replicas) == 1:
        return replicas[0]
    names = [f.name for f in fields(SchedulerStats) if f.name != "dp_rank"]
    return SchedulerStats(**{n: sum(getattr(r, n) for r in replicas) for n in names})


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
        watchdog_timeout: float = 0.0,
        on_hang: Callable[[str], None] | None = None,
        scheduler_addrs: list[str] | None = None,
        api_rank: int = 0,
        api_addrs: list[str] | None = None,
    ) -> None:
        """`watchdog_timeout` 0: no watchdog; else `on_hang(reason)` is called (on a thread of
        its own) once the pipeline has been silent that long with a request unfinished, or
        when another API process reports a failure to rank 0.
        `scheduler_addrs`: one per --dp replica (for /flush_cache; none: it is refused).
        `api_addrs`: every API process's `recv_addr`, by rank (None: this one alone)."""
        self.to_tokenizers = [ZmqAsyncPushQueue(a, create=False) for a in tokenizer_addrs]
        self.recv = ZmqAsyncPullQueue(recv_addr, create=True)
        self.scheduler_addrs = scheduler_addrs or []
        self.api_rank, self.api_count = api_rank, len(api_addrs or [recv_addr])
        self.to_peers = {
            rank: ZmqAsyncPushQueue(addr, create=False)
            for rank, addr in enumerate(api_addrs or [])
            if rank != api_rank
        }
        self._views: dict[int, asyncio.Queue[ApiViewMsg]] = {}  # by query number
        self._view_seqs = itertools.count()
        self.requests: dict[int, _InFlight] = {}
        self.uids = itertools.count(api_rank, self.api_count)
        self.replica_stats = [SchedulerStats(dp_rank=r) for r in range(self.num_replicas)]
        # the server's RSS is rank 0's to count (its children include the other API processes)
        self.rss: Callable[[], int] = tree_rss_bytes if api_rank == 0 else lambda: 0
        observer = extensions().request_observer
        self.metrics = RequestObserver() if observer is None else observer(self)
        self._flushes: asyncio.Queue[FlushCacheReply] | None = None
        self._flush_lock: asyncio.Lock | None = None
        self.dead: str | None = None  # set when the pipeline can no longer answer
        self.watchdog_timeout, self.on_hang = watchdog_timeout, on_hang
        self.last_progress = time.monotonic()  # of the last message, or of the last idle tick
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks.append(self._loop.create_task(self._dispatch()))
        if self.watchdog_timeout > 0 and self.on_hang is not None:
            self._tasks.append(self._loop.create_task(self._watchdog()))

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

    async def _watchdog(self) -> None:
        while self.dead is None:
            await asyncio.sleep(min(1.0, self.watchdog_timeout / 4))
            if not self.num_unfinished:  # nothing owed: silence counts from now on
                self.last_progress = time.monotonic()
                continue
            silent = time.monotonic() - self.last_progress
            if silent > self.watchdog_timeout and self.dead is None:
                reason = (
                    f"watchdog: no progress for {silent:.0f} s (--watchdog-timeout "
                    f"{self.watchdog_timeout:g}) with {self.num_unfinished} requests unfinished"
                )
                assert self.on_hang is not None
                # on a thread: stopping the server waits, this loop must go on serving errors
                threading.Thread(target=self.on_hang, args=(reason,), daemon=True).start()
                return

    async def _dispatch(self) -> None:
        while True:
            batch = await self.recv.get()
            self.last_progress = time.monotonic()
            if isinstance(batch, FlushCacheReply) and self._flushes is not None:
                self._flushes.put_nowait(batch)
                continue
            if isinstance(batch, (ApiQueryMsg, ApiViewMsg, ApiFailMsg)):
                await self._from_peer(batch)
                continue
            if not isinstance(batch, BatchFrontendMsg):  # decoded, but not for here
                logger.error("api server: dropped an unexpected %s message", type(batch).__name__)
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

    async def _from_peer(self, msg: ApiQueryMsg | ApiViewMsg | ApiFailMsg) -> None:
        if isinstance(msg, ApiQueryMsg):
            if msg.rank in self.to_peers:
                await self.to_peers[msg.rank].put(self.view(msg.seq, msg.metrics))
        elif isinstance(msg, ApiViewMsg):
            if msg.seq in self._views:  # else: too late, the query timed out
                self._views[msg.seq].put_nowait(msg)
        elif self.api_rank == 0 and self.on_hang is not None:  # the launcher fails the server
            threading.Thread(target=self.on_hang, args=(msg.reason,), daemon=True).start()
        else:
            self.fail(msg.reason)

    def view(self, seq: int = 0, metrics: bool = False) -> ApiViewMsg:
        """What this API process counts: requests in flight, not started yet (and with
        `metrics` the text of its metrics)."""
        text = self.metrics.text() if metrics else ""
        return ApiViewMsg(
            self.api_rank, seq, os.getpid(), len(self.requests), self.num_queued, text, self.rss()
        )

    async def views(self, metrics: bool = False) -> list[ApiViewMsg]:
        """Every API process's view, by rank (this one's alone without --api-server-count);
        TimeoutError when one does not answer in time."""
        if not self.to_peers:
            return [self.view(0, metrics)]
        seq = next(self._view_seqs)
        answers = self._views[seq] = asyncio.Queue()
        try:
            for queue in self.to_peers.values():
                await queue.put(ApiQueryMsg(self.api_rank, seq, metrics))
            views = [self.view(seq, metrics)]
            deadline = time.monotonic() + VIEW_TIMEOUT_S
            while len(views) < self.api_count:
                views.append(await asyncio.wait_for(answers.get(), deadline - time.monotonic()))
            return sorted(views, key=lambda v: v.rank)
        finally:
            del self._views[seq]

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

    async def flush_cache(self) -> list[str]:
        """Empty every replica's prefix cache (each refuses while requests run); the errors."""
        if not self.scheduler_addrs:
            return ["this front end has no scheduler to flush"]
        if self._flush_lock is None:
            self._flush_lock, self._flushes = asyncio.Lock(), asyncio.Queue()
        assert self._flushes is not None
        async with self._flush_lock:  # one flush at a time: the replies are not tagged
            while not self._flushes.empty():  # late answers of a flush that timed out
                self._flushes.get_nowait()
            for addr in self.scheduler_addrs:
                queue = ZmqAsyncPushQueue(addr, create=False)
                try:
                    await queue.put(FlushCacheMsg(self.api_rank))
                finally:
                    queue.close()  # lingers until the message is out
            errors: list[str] = []
            for _ in self.scheduler_addrs:
                try:
                    reply = await asyncio.wait_for(self._flushes.get(), FLUSH_TIMEOUT_S)
                except asyncio.TimeoutError:
                    return errors + [f"no answer from the schedulers in {FLUSH_TIMEOUT_S:g} s"]
                if reply.error is not None:
                    errors.append(f"replica {reply.dp_rank}: {reply.error}")
            return errors

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
