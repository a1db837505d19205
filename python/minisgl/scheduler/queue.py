"""WaitingQueue: the requests waiting for admission, first come first served, and who gives way
when pages run out (another --schedule-policy is an extension's subclass)."""

# every TP rank picks alike, so a policy looks at nothing but the requests and the prefix cache

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from minisgl.core import PLACEHOLDER, Req
from minisgl.extension import extensions

if TYPE_CHECKING:  # torch: ext/serving's policies subclass WaitingQueue in the API process too
    from minisgl.kvcache.manager import KVCacheManager
from minisgl.scheduler.config import SchedulerConfig


class WaitingQueue(deque[Req]):
    """The waiting requests in order (`appendleft`: a preempted one back in front)."""

    def first(self) -> Req | None:
        """The next to admit: the oldest."""
        return self.ready(self[0]) if self else None

    @staticmethod
    def ready(req: Req) -> Req | None:
        """`req`, or None while its last token is still computed (preempted this step)."""
        return req if req.tokens[-1] != PLACEHOLDER else None

    def victim_for(self, req: Req, running: list[Req]) -> Req | None:
        """The running request that `req`, which does not fit, preempts (None: it waits)."""
        return None

    def decode_victim(self, running: list[Req], prefilling: Req | None) -> Req:
        """Who gives up its pages when a decode finds none: the half-prefilled, else the newest."""
        # (of the running requests, the newest has the least work to redo)
        return prefilling or running[-1]


def make_queue(config: SchedulerConfig, cache: KVCacheManager) -> WaitingQueue:
    """The queue of --schedule-policy (fcfs, else an extension's: SchedulerConfig checked it)."""
    if config.schedule_policy == "fcfs":
        return WaitingQueue()
    return extensions().admission_policies[config.schedule_policy](config, cache)
