"""Tensor parallelism: rank 0 broadcasts the changes to its request table with each step; the
other ranks replay them and step with it (`Scheduler.follow`)."""

# Every rank runs a Scheduler over its own Engine shard. Scheduling is deterministic and sampled
# tokens are equal on every rank, so the ranks stay in step as long as they see the same
# changes: each add (with its seed), abort, cache flush, and the extensions' changes (e.g. the
# admission of a request a feature held: whether a grammar has compiled differs between ranks,
# so rank 0 decides).

from __future__ import annotations

from typing import Any

from minisgl.distributed import broadcast_object
from minisgl.message import BatchMsg, ExitMsg, decode, encode


class TPLeader:
    """Rank 0's changes (adds with their seeds, aborts, flushes, extensions') not sent yet."""

    def __init__(self) -> None:
        self.changes: list[Any] = []

    def send(self, stop: bool = False) -> None:
        broadcast_object(encode(ExitMsg() if stop else BatchMsg(self.changes)))
        self.changes = []


def receive_step() -> BatchMsg | ExitMsg:
    """Ranks > 0: rank 0's next message (waits for it)."""
    return decode(broadcast_object(None))
