"""/flush_cache's messages and the scheduler process's side of it (the `scheduler_messages`
point): an API process asks every --dp replica's scheduler (`FlushCacheRequest`), each empties
its prefix cache through `Scheduler.flush_cache` (which refuses while requests run and replays
the flush on its TP ranks) and answers (`FlushCacheReply`) through the detokenizer, which passes
the answer on to the API processes' queue (`apis.py` routes it to the one that asked)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.message import BatchMsg, register

if TYPE_CHECKING:  # types only: the scheduler's modules load torch
    from minisgl.scheduler.io import SchedulerServer


@register
@dataclass
class FlushCacheRequest:
    """API process -> each replica's scheduler: empty the prefix cache unless requests run."""

    api_rank: int = 0  # the API process (--api-server-count) that waits for the reply


@register
@dataclass
class FlushCacheReply:
    """One replica's answer to `FlushCacheRequest` (`error` None: its prefix cache is empty)."""

    dp_rank: int
    error: str | None = None
    api_rank: int = 0  # the API process that asked (`FlushCacheRequest.api_rank`)


def handle_flush(server: SchedulerServer, msg: FlushCacheRequest) -> None:
    """In the scheduler process (rank 0 of a replica): flush, then answer."""
    error = server.scheduler.flush_cache()
    # the stats first, on the same ordered path: a /stats read after the flush's answer shows
    # the emptied cache (the other order raced under load)
    server.send.put(BatchMsg([], server.stats()))
    server.send.put(FlushCacheReply(server.dp_rank, error, msg.api_rank))
