"""The serving extension's Frontend (made by its launcher, `scale.py`): the core's, plus

- the metrics (`metrics.py`): every reply and every request ended early counted, the --dp
  replicas' scheduler snapshots kept apart (`replica_stats`; `stats` sums them);
- the watchdog: while a request is unfinished, some message must come back from the pipeline
  at least every --watchdog-timeout seconds (the scheduler sends its stats every 0.2 s while it
  has work), or the pipeline is taken for hung and `on_hang(reason)` is called;
- /flush_cache: every --dp replica's scheduler empties its prefix cache (`ask_schedulers`, which
  ext/lora's runtime adapter routes use too);
- with --api-server-count N, the API processes' views of each other (`views`: /stats and
  /metrics add them up) and a failure passed on (`ApiFailMsg`: rank 0's launcher fails the
  server; the others fail their own requests);
- the request limits: this process's share of --max-queued-requests (`admit`: 503 beyond it)
  and --request-timeout (`expire`: 504, the request aborted)."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from minisgl.ext.serving.flush import FlushCacheReply, FlushCacheRequest
from minisgl.ext.serving.metrics import ApiViewMsg, frontend_metrics, total_stats, tree_rss_bytes
from minisgl.ext.serving.worker import DoneMsg
from minisgl.message import AbortMsg, SchedulerStats, TokenizeMsg, UserReply, register
from minisgl.server.frontend import Frontend, _InFlight
from minisgl.server.protocol import APIError
from minisgl.utils.zmq import ZmqAsyncPushQueue

R = TypeVar("R")
FLUSH_TIMEOUT_S = 10.0  # for every replica's answer to /flush_cache
VIEW_TIMEOUT_S = 5.0  # for the other API processes' views (/stats, /metrics)


@register
@dataclass
class ApiQueryMsg:
    """API process `rank` -> the others: send me your view (`ApiViewMsg`), for /stats and
    /metrics, which add up what every API process counts."""

    rank: int
    seq: int
    metrics: bool  # with the text of its metrics (/metrics), or only the counts (/stats)


@register
@dataclass
class ApiFailMsg:
    """The server failed for `reason` (sent to the other API processes)."""

    reason: str


@dataclass
class _Served(_InFlight):
    """A request in flight, with what the metrics and --request-timeout read of it."""

    submitted: float = field(default_factory=time.monotonic)
    priority: int = 0  # (the metrics' label)
    finished: bool = False  # its last reply came (the handler may not have collected it yet)


class ServingFrontend(Frontend):
    def __init__(
        self,
        tokenizer_addrs: list[str],
        recv_addr: str,
        watchdog_timeout: float = 0.0,
        on_hang: Callable[[str], None] | None = None,
        scheduler_addrs: list[str] | None = None,
        api_rank: int = 0,
        api_addrs: list[str] | None = None,
        max_queued_requests: int | None = None,
        request_timeout: float | None = None,
    ) -> None:
        """`watchdog_timeout` 0: no watchdog; else `on_hang(reason)` is called (on a thread of
        its own) once the pipeline has been silent that long with a request unfinished, or
        when another API process reports a failure to rank 0.
        `scheduler_addrs`: one per --dp replica (`ask_schedulers`; none: /flush_cache is refused).
        `api_addrs`: every API process's `recv_addr`, by rank (None: this one alone).
        `max_queued_requests`, `request_timeout`: the server's flags (None: no limit)."""
        # API process `api_rank` of `api_count` numbers its requests api_rank, api_rank +
        # api_count... (their replies come back by uid)
        self.api_rank, self.api_count = api_rank, len(api_addrs or [recv_addr])
        self.scheduler_addrs = scheduler_addrs or []
        replicas = max(1, len(self.scheduler_addrs))
        self.replica_stats = [SchedulerStats(dp_rank=r) for r in range(replicas)]
        super().__init__(tokenizer_addrs, recv_addr)
        self.uids = itertools.count(api_rank, self.api_count)
        self.metrics = frontend_metrics(self)
        self.to_peers = {
            rank: ZmqAsyncPushQueue(addr, create=False)
            for rank, addr in enumerate(api_addrs or [])
            if rank != api_rank
        }
        self._views: dict[int, asyncio.Queue[ApiViewMsg]] = {}  # by query number
        self._view_seqs = itertools.count()
        self._asks: dict[type, asyncio.Queue[Any]] = {}  # `ask_schedulers`' replies, by type
        self._ask_lock: asyncio.Lock | None = None
        self.watchdog_timeout, self.on_hang = watchdog_timeout, on_hang
        self.on_drain: Callable[[], None] | None = None  # SIGTERM: its launcher's `drain`
        self.max_queued = max_queued_requests  # this process's share of them (None: no limit)
        if max_queued_requests is not None:
            self.max_queued = -(-max_queued_requests // self.api_count)
        self.request_timeout = request_timeout
        self._timers: dict[int, asyncio.TimerHandle] = {}  # by uid: its `expire`
        self._aborts: set[asyncio.Task] = set()  # the aborts of expired requests being sent

    @property  # the core's attribute, kept per replica here
    def stats(self) -> SchedulerStats:
        """The scheduler snapshot, summed over the --dp replicas."""
        return total_stats(self.replica_stats)

    @stats.setter
    def stats(self, snapshot: SchedulerStats) -> None:
        if 0 <= snapshot.dp_rank < len(self.replica_stats):  # its replica's latest
            self.replica_stats[snapshot.dp_rank] = snapshot

    def _in_flight(self, msg: TokenizeMsg, queue: asyncio.Queue[UserReply]) -> _Served:
        return _Served(queue, priority=msg.params.get("priority"))

    @property
    def served(self) -> dict[int, _Served]:
        return cast(dict[int, _Served], self.requests)  # (`_in_flight` makes them)

    def _observe(self, req: _InFlight, reply: UserReply, now: float) -> None:
        served = cast(_Served, req)
        # first: the metrics read the time of the request's previous token
        self.metrics.reply(served.priority, served.submitted, req.last_token, reply, now)
        super()._observe(req, reply, now)
        if reply.finished:
            served.finished = True

    @property
    def num_unfinished(self) -> int:
        """Requests in flight whose last reply has not come: the pipeline owes them answers."""
        return sum(not r.finished for r in self.served.values())

    def start(self) -> None:
        super().start()
        if self.watchdog_timeout > 0 and self.on_hang is not None:
            assert self._loop is not None
            self._tasks.append(self._loop.create_task(self._watchdog()))

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

    async def received(self, msg: Any) -> bool:
        if (answers := self._asks.get(type(msg))) is not None:  # `ask_schedulers`'
            answers.put_nowait(msg)
        elif isinstance(msg, ApiQueryMsg):
            if msg.rank in self.to_peers:
                await self.to_peers[msg.rank].put(self.view(msg.seq, msg.metrics))
        elif isinstance(msg, ApiViewMsg):
            if msg.seq in self._views:  # else: too late, the query timed out
                self._views[msg.seq].put_nowait(msg)
        elif isinstance(msg, ApiFailMsg):
            if self.api_rank == 0 and self.on_hang is not None:  # the launcher fails the server
                threading.Thread(target=self.on_hang, args=(msg.reason,), daemon=True).start()
            else:
                self.fail(msg.reason)
        else:
            return False
        return True

    def admit(self) -> None:
        """503 while this process's share of --max-queued-requests wait to start."""
        super().admit()
        limit, queued = self.max_queued, self.num_queued
        if limit is not None and queued >= limit:
            message = f"server overloaded: {queued} requests are waiting to start (limit {limit})"
            retry = {"Retry-After": "1"}
            raise APIError(503, message + "; retry later", code="overloaded", headers=retry)

    async def submit(self, msg: TokenizeMsg, queue: asyncio.Queue[UserReply]) -> None:
        """The core's, with the request's `expire` due after --request-timeout."""
        await super().submit(msg, queue)
        if self.request_timeout is not None:
            loop = asyncio.get_running_loop()
            self._timers[msg.uid] = loop.call_later(self.request_timeout, self.expire, msg.uid)

    def expire(self, uid: int) -> None:
        """Request `uid` ran past --request-timeout: its last reply is a timeout error (504, or
        a stream's error event), later ones are dropped, and the pipeline aborts it."""
        self._timers.pop(uid, None)
        req = self.served.get(uid)
        if req is None or req.finished:  # its last reply came in time
            return
        # ended here, so its handler's `done` sends no DoneMsg (the abort uncounts it at the
        # --dp dispatcher, which must see the abort first to find its replica)
        del self.requests[uid]
        self.metrics.ended("timeout")
        error = f"request timed out after {self.request_timeout:g} s"
        req.queue.put_nowait(UserReply(uid, "", [], True, "timeout", 0, 0, error))
        task = asyncio.ensure_future(self._tokenizer(uid).put(AbortMsg(uid)))
        self._aborts.add(task)  # held until sent (the loop keeps only weak references)
        task.add_done_callback(self._aborts.discard)

    def _untime(self, uid: int) -> None:
        if (timer := self._timers.pop(uid, None)) is not None:
            timer.cancel()

    async def abort(self, uid: int) -> None:
        self._untime(uid)
        if uid in self.requests:  # still in flight: ended early
            self.metrics.ended("abort")
        await super().abort(uid)

    async def done(self, uid: int) -> None:
        self._untime(uid)
        counted = uid in self.requests  # not one that `expire` ended
        await super().done(uid)
        if counted and len(self.scheduler_addrs) > 1:  # the --dp dispatcher counts the loads
            await asyncio.shield(self._tokenizer(uid).put(DoneMsg(uid)))

    def view(self, seq: int = 0, metrics: bool = False) -> ApiViewMsg:
        """This API process's counts: requests in flight, not started yet (and with `metrics`
        the text of its metrics); the server's RSS is rank 0's to count (its children include
        the other API processes)."""
        text = self.metrics.text() if metrics else ""
        rss = tree_rss_bytes() if self.api_rank == 0 else 0
        queued = self.num_queued
        return ApiViewMsg(self.api_rank, seq, os.getpid(), len(self.requests), queued, text, rss)

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

    async def flush_cache(self) -> list[str]:
        """Empty every replica's prefix cache (each refuses while requests run); the errors."""
        if not self.scheduler_addrs:
            return ["this front end has no scheduler to flush"]
        replies = await self.ask_schedulers(FlushCacheRequest, FlushCacheReply, FLUSH_TIMEOUT_S)
        errors = [f"replica {r.dp_rank}: {r.error}" for r in replies if r.error is not None]
        if len(replies) < len(self.scheduler_addrs):
            errors.append(f"no answer from the schedulers in {FLUSH_TIMEOUT_S:g} s")
        return errors

    async def ask_schedulers(
        self, make_msg: Callable[[int], Any], reply_type: type[R], timeout: float
    ) -> list[R]:
        """Send `make_msg(api_rank)` to every --dp replica's scheduler (an extension's
        `scheduler_messages` handler answers it through the detokenizer) -> their replies of
        `reply_type`, fewer than the replicas when one does not answer within `timeout` s."""
        if self._ask_lock is None:
            self._ask_lock = asyncio.Lock()
        queue = self._asks.setdefault(reply_type, asyncio.Queue())
        async with self._ask_lock:  # one question at a time: the replies are not tagged
            while not queue.empty():  # late answers of a question that timed out
                queue.get_nowait()
            for addr in self.scheduler_addrs:
                push = ZmqAsyncPushQueue(addr, create=False)
                try:
                    await push.put(make_msg(self.api_rank))
                finally:
                    push.close()  # lingers until the message is out
            replies: list[R] = []
            deadline = time.monotonic() + timeout
            for _ in self.scheduler_addrs:
                left = deadline - time.monotonic()
                try:
                    replies.append(await asyncio.wait_for(queue.get(), left))
                except asyncio.TimeoutError:
                    break
            return replies
