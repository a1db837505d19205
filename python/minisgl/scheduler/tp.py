"""Tensor parallelism: every rank runs a Scheduler over its own Engine shard. Scheduling is
deterministic and sampled tokens are equal on every rank, so the ranks stay in step as long as
they see the same changes: rank 0's `TPLeader` records each add (with its seed), admission of
a held request (whether a grammar has compiled differs between ranks, so rank 0 decides),
abort and cache flush (sent at once: an idle rank 0 does not step), and broadcasts them at its
next step as one `BatchBackendMsg`; the others replay them and step (`Scheduler.follow`)."""

from __future__ import annotations

from dataclasses import replace

from minisgl.core import Req
from minisgl.distributed import broadcast_object
from minisgl.message import (
    AbortBackendMsg,
    AdmitBackendMsg,
    BatchBackendMsg,
    ExitMsg,
    FlushCacheMsg,
    UserMsg,
    decode,
    encode,
)


class TPLeader:
    def __init__(self) -> None:
        # not yet seen by the other ranks
        self.changes: list[UserMsg | AdmitBackendMsg | AbortBackendMsg | FlushCacheMsg] = []

    def added(self, req: Req) -> None:
        params = replace(req.params, seed=req.seed)
        self.changes.append(UserMsg(req.uid, req.tokens[: req.prompt_len], params))

    def admitted(self, uid: int) -> None:
        self.changes.append(AdmitBackendMsg(uid))

    def aborted(self, uid: int) -> None:
        self.changes.append(AbortBackendMsg(uid))

    def flushed(self) -> None:
        """The other ranks empty their caches too, now."""
        self.changes.append(FlushCacheMsg())
        self.send()

    def send(self, stop: bool = False) -> None:
        broadcast_object(encode(ExitMsg() if stop else BatchBackendMsg(self.changes)))
        self.changes = []


def receive_step() -> BatchBackendMsg | ExitMsg:
    """Ranks > 0: rank 0's next message (waits for it)."""
    return decode(broadcast_object(None))
