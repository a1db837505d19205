"""Tensor parallelism: rank 0 broadcasts the changes to its request table with each step; the
other ranks replay them and step with it (`Scheduler.follow`)."""

# Every rank runs a Scheduler over its own Engine shard. Scheduling is deterministic and sampled
# tokens are equal on every rank, so the ranks stay in step as long as they see the same
# changes: each add (with its seed), admission of a held request (whether a grammar has
# compiled differs between ranks, so rank 0 decides), abort and cache flush.

from __future__ import annotations

from minisgl.distributed import broadcast_object
from minisgl.message import (
    AbortBackendMsg,
    AdmitBackendMsg,
    BatchMsg,
    ExitMsg,
    FlushCacheMsg,
    UserMsg,
    decode,
    encode,
)


class TPLeader:
    """Rank 0's changes (adds with their seeds, admissions, aborts, flushes) not sent yet."""

    def __init__(self) -> None:
        self.changes: list[UserMsg | AdmitBackendMsg | AbortBackendMsg | FlushCacheMsg] = []

    def send(self, stop: bool = False) -> None:
        broadcast_object(encode(ExitMsg() if stop else BatchMsg(self.changes)))
        self.changes = []


def receive_step() -> BatchMsg | ExitMsg:
    """Ranks > 0: rank 0's next message (waits for it)."""
    return decode(broadcast_object(None))
