"""The API server's side of the pipeline: submit requests to the tokenizer workers, route
the detokenizer's replies to one asyncio queue per request, fail them all if the pipeline dies."""

# The serving extension's Frontend (`ext/serving/frontend.py`) adds the metrics, the watchdog,
# /flush_cache, the --dp replicas, the API processes' views of each other,
# --max-queued-requests (`admit`) and --request-timeout.

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from minisgl.message import AbortMsg, BatchMsg, SchedulerStats, TokenizeMsg, UserReply, encode
from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    # (the serving extension's `_Served` adds what its metrics and --request-timeout read)
    queue: asyncio.Queue[UserReply]  # its response's: shared by the choices (`batches`)
    last_token: float | None = None  # None until the first token: the request is queued


class Frontend:
    def __init__(self, tokenizer_addrs: list[str], recv_addr: str) -> None:
        self.to_tokenizers = [ZmqAsyncPushQueue(a, create=False) for a in tokenizer_addrs]
        self.recv = ZmqAsyncPullQueue(recv_addr, create=True)
        self.requests: dict[int, _InFlight] = {}
        self.uids = itertools.count()  # (the replies come back by uid)
        self.stats = SchedulerStats()  # the scheduler's last snapshot
        self.dead: str | None = None  # set when the pipeline can no longer answer
        self.last_progress = time.monotonic()  # of the last message (the watchdog's)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks.append(self._loop.create_task(self._dispatch()))

    @property
    def num_queued(self) -> int:
        """Requests submitted that have not produced a token yet."""
        return sum(r.last_token is None for r in self.requests.values())

    async def _dispatch(self) -> None:
        while True:
            batch = await self.recv.get()
            self.last_progress = time.monotonic()
            if not isinstance(batch, BatchMsg):
                if not await self.received(batch):
                    logger.error("api server: dropped an unexpected %s", type(batch).__name__)
                continue
            if batch.stats is not None:
                self.stats = batch.stats
            now = time.monotonic()
            for reply in batch.msgs:
                if (req := self.requests.get(reply.uid)) is not None:
                    self._observe(req, reply, now)
                    req.queue.put_nowait(reply)

    async def received(self, msg: Any) -> bool:
        """A message other than replies (the serving extension's); False: not one expected."""
        return False

    def _observe(self, req: _InFlight, reply: UserReply, now: float) -> None:
        if reply.token_ids:
            req.last_token = now

    def new_uid(self) -> int:
        return next(self.uids)

    def admit(self) -> None:
        """An APIError refuses a request: 503 once the pipeline is dead (ext/serving: limits)."""
        if self.dead is not None:
            from minisgl.server.protocol import APIError  # the HTTP front end's (pydantic)

            raise APIError(503, f"server is shutting down: {self.dead}", code="server_unavailable")

    def _tokenizer(self, uid: int) -> ZmqAsyncPushQueue:
        return self.to_tokenizers[uid % len(self.to_tokenizers)]

    async def submit(self, msg: TokenizeMsg, queue: asyncio.Queue[UserReply]) -> None:
        """Hand a request to its tokenizer worker, its replies to `queue`: in flight once sent."""
        data = encode(msg)
        self.requests[msg.uid] = self._in_flight(msg, queue)
        try:
            await self._tokenizer(msg.uid).put_encoded(data)
        except BaseException:
            self.requests.pop(msg.uid, None)
            raise

    def _in_flight(self, msg: TokenizeMsg, queue: asyncio.Queue[UserReply]) -> _InFlight:
        return _InFlight(queue)  # (the serving extension's record reads `msg`'s priority)

    async def abort(self, uid: int) -> None:
        if self.requests.pop(uid, None) is not None:
            await self._tokenizer(uid).put(AbortMsg(uid))

    async def batches(
        self, msgs: list[TokenizeMsg]
    ) -> AsyncGenerator[list[tuple[int, UserReply]], None]:
        """Replies of requests `msgs` (a response's choices) tagged with their index, each time
        all that have come (a handler that fell behind catches up in one write); each submitted
        once the one before has answered, unless with an error; the unfinished aborted when left."""
        queue: asyncio.Queue[UserReply] = asyncio.Queue()
        index = {m.uid: i for i, m in enumerate(msgs)}
        await self.submit(msgs[0], queue)
        submitted, unfinished = [msgs[0].uid], {msgs[0].uid}
        try:
            while unfinished:
                batch, tagged = [await queue.get()], list[tuple[int, UserReply]]()
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for r in batch:
                    if r.uid not in unfinished:
                        continue  # after its last reply (`fail` may add one): dropped
                    tagged.append((index[r.uid], r))
                    if r.finished:
                        unfinished.discard(r.uid)
                if len(submitted) < len(msgs) and any(  # the last one's first reply, no error
                    r.uid == submitted[-1] and r.error is None for _, r in tagged
                ):
                    await self.submit(msgs[len(submitted)], queue)
                    submitted.append(msgs[len(submitted)].uid)
                    unfinished.add(submitted[-1])
                yield tagged
        finally:  # each one, even in a handler cancelled again at every await (a client left)
            ends = [self.abort(u) if u in unfinished else self.done(u) for u in submitted]
            await asyncio.shield(asyncio.gather(*ends))

    async def done(self, uid: int) -> None:
        """Request `uid`'s last reply was taken."""
        self.requests.pop(uid, None)

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
