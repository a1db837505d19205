"""The api server's side of the pipeline: submit requests to the tokenizer workers and route
the replies coming back from the detokenizer to one asyncio queue per request."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from minisgl.message import AbortMsg, BatchFrontendMsg, SchedulerStats, TokenizeMsg, UserReply
from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue


class Frontend:
    def __init__(self, tokenizer_addrs: list[str], recv_addr: str) -> None:
        self.to_tokenizers = [ZmqAsyncPushQueue(a, create=False) for a in tokenizer_addrs]
        self.recv = ZmqAsyncPullQueue(recv_addr, create=True)
        self.queues: dict[int, asyncio.Queue[UserReply]] = {}
        self.uids = itertools.count()
        self.stats = SchedulerStats()
        self.dead: str | None = None  # set when the pipeline can no longer answer
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._dispatch())

    async def _dispatch(self) -> None:
        while True:
            batch: BatchFrontendMsg = await self.recv.get()
            if batch.stats is not None:
                self.stats = batch.stats
            for reply in batch.msgs:
                queue = self.queues.get(reply.uid)
                if queue is not None:
                    queue.put_nowait(reply)

    def new_uid(self) -> int:
        return next(self.uids)

    def _tokenizer(self, uid: int) -> ZmqAsyncPushQueue:
        return self.to_tokenizers[uid % len(self.to_tokenizers)]

    async def submit(self, msg: TokenizeMsg) -> asyncio.Queue[UserReply]:
        queue: asyncio.Queue[UserReply] = asyncio.Queue()
        self.queues[msg.uid] = queue
        await self._tokenizer(msg.uid).put(msg)
        return queue

    async def abort(self, uid: int) -> None:
        if self.queues.pop(uid, None) is not None:
            await self._tokenizer(uid).put(AbortMsg(uid))

    async def stream(self, msg: TokenizeMsg) -> AsyncIterator[UserReply]:
        """Replies of one request until it finishes. Leaving early (client gone) aborts it."""
        queue = await self.submit(msg)
        finished = False
        try:
            while not finished:
                reply = await queue.get()
                finished = reply.finished
                yield reply
        finally:
            if finished:
                self.queues.pop(msg.uid, None)
            else:
                await asyncio.shield(self.abort(msg.uid))
