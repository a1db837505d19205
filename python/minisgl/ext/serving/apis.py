"""The pipeline's replies to --api-server-count's API processes (the launcher's `api_queue`): the
tokenizer workers and the detokenizer put them on one `ApiQueues`, which routes each to the
process that waits for it."""

from __future__ import annotations

import logging
from typing import Any

from minisgl.message import BatchMsg
from minisgl.utils.zmq import ZmqPushQueue

logger = logging.getLogger(__name__)


class ApiQueues:
    """The API processes' queues as one: process k numbers its requests k, k + N, k + 2N...,
    so a reply goes to uid % N; the scheduler's stats go to every one, any other message (a
    /flush_cache answer) to the process that asked, its `api_rank`."""

    def __init__(self, queues: list[Any]) -> None:
        self.queues = queues

    @staticmethod
    def connect(addrs: list[str]) -> ApiQueues:
        """In a pipeline process: the queues of the API processes at `addrs`, by rank."""
        return ApiQueues([ZmqPushQueue(addr, create=False) for addr in addrs])

    def put(self, msg: Any) -> None:
        if isinstance(msg, BatchMsg):
            for rank, queue in enumerate(self.queues):
                group = [r for r in msg.msgs if r.uid % len(self.queues) == rank]
                if group or msg.stats is not None:
                    queue.put(BatchMsg(group, msg.stats))
            return
        api_rank = getattr(msg, "api_rank", None)
        if isinstance(api_rank, int) and 0 <= api_rank < len(self.queues):
            self.queues[api_rank].put(msg)
        else:
            logger.error("dropped a %s for API process %r", type(msg).__name__, api_rank)
