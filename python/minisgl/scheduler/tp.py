"""Tensor parallelism: every rank runs a Scheduler over its own Engine shard. Scheduling is
deterministic and sampled tokens are equal on every rank (the logits are all-gathered), so the
ranks stay in step as long as they see the same requests: rank 0's `TPLeader` records each add
and abort and broadcasts them at the start of its next step; the others receive them
(`receive_step`), replay them and step (`Scheduler.follow`)."""

from __future__ import annotations

from minisgl.core import Req
from minisgl.distributed import broadcast_object
from minisgl.message import AbortBackendMsg, TPAddMsg, TPStepMsg, decode, encode


class TPLeader:
    def __init__(self) -> None:
        self.changes: list[TPAddMsg | AbortBackendMsg] = []  # not yet seen by the other ranks

    def added(self, req: Req) -> None:
        self.changes.append(TPAddMsg(req.uid, req.tokens[: req.prompt_len], req.params, req.seed))

    def aborted(self, uid: int) -> None:
        self.changes.append(AbortBackendMsg(uid))

    def send(self, stop: bool = False) -> None:
        broadcast_object(encode(TPStepMsg(self.changes, stop)))
        self.changes = []


def receive_step() -> TPStepMsg:
    """Ranks > 0: rank 0's next message (waits for it)."""
    return decode(broadcast_object(None))
