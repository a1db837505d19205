"""WaitingQueue: the requests waiting for admission, and which one goes next under
--schedule-policy. Every TP rank keeps the same queue and picks alike: the order depends on
nothing but the requests and the prefix cache (arrival is a count, not a clock)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Literal

from minisgl.core import PLACEHOLDER, Req
from minisgl.kvcache import KVCacheManager

LPM_MAX_QUEUE = 128  # lpm ranks at most this many waiting requests (as SGLang): beyond, fcfs
Policy = Literal["fcfs", "priority", "lpm"]


class WaitingQueue:
    """`append` queues a new request (it gets the next arrival number), `appendleft` puts a
    preempted one back (its arrival kept). `first` is the next to admit: the oldest (fcfs), the
    best `rank` (priority), or the longest cached prefix (lpm, oldest first among equals)."""

    def __init__(self, policy: Policy, aging: int, cache: KVCacheManager) -> None:
        self.policy, self.aging, self.cache = policy, aging, cache
        self.reqs: deque[Req] = deque()
        self.num_queued = 0

    def __len__(self) -> int:
        return len(self.reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs)

    def __contains__(self, req: object) -> bool:
        return req in self.reqs

    def append(self, req: Req) -> None:
        req.arrival, self.num_queued = self.num_queued, self.num_queued + 1
        self.reqs.append(req)

    def appendleft(self, req: Req) -> None:
        self.reqs.appendleft(req)

    def remove(self, req: Req) -> None:
        self.reqs.remove(req)

    def rank(self, req: Req) -> tuple[float, int]:
        """Lower goes first: the priority, aged by arrival (a request queued `aging` requests
        later counts one level lower: a fixed order, so no two requests preempt each other back
        and forth, and a request is overtaken by a bounded number of later ones)."""
        priority = req.params.priority
        return (priority + req.arrival / self.aging if self.aging else priority, req.arrival)

    def first(self) -> Req | None:
        """The next to admit; None while it is one that this very step preempted (its last
        token is still being computed): it is admitted next step, and no later one before it."""
        if not self.reqs:
            return None
        if self.policy == "priority":
            best = min(self.reqs, key=self.rank)
        elif self.policy == "lpm" and len(self.reqs) <= LPM_MAX_QUEUE:
            best = max(self.reqs, key=lambda r: (self.cache.cached_length(r.tokens), -r.arrival))
        else:
            best = self.reqs[0]
        return best if best.tokens[-1] != PLACEHOLDER else None
