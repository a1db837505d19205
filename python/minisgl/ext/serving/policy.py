"""The waiting queue's other orders (the `admission_policies` point: --schedule-policy) and the
request field one of them reads (`priority`, checked through the `sampling_params` point):

- `priority`: the lowest `priority` first, aged by admissions (--priority-aging); a request
  that does not fit preempts the running one ranked last if that one ranks after it, and a
  decode short of pages preempts the admitted request ranked last;
- `lpm`: the longest cached prefix first (the oldest among equals), fcfs beyond LPM_MAX_QUEUE
  waiting; it preempts as fcfs does.

Without this module `priority` in a request and any --schedule-policy but fcfs are refused,
naming them. Every TP rank orders alike: arrival and age are counts, not a clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.queue import WaitingQueue
from minisgl.utils.options import int_range, option

if TYPE_CHECKING:  # torch: this module registers in processes without it (the API process)
    from minisgl.kvcache.manager import KVCacheManager

LPM_MAX_QUEUE = 128  # lpm ranks at most this many waiting requests (as SGLang): beyond, fcfs
PRIORITY_RANGE = (-(2**31), 2**31)  # vLLM's and SGLang's int32


@dataclass
class PolicyOptions:
    """The policies' scheduler options (`scheduler_options["serving"]`)."""

    priority_aging: int = option(
        256,
        "priority policy: a request queued after this many more admissions ranks one priority"
        " level lower, so no request is overtaken forever (0: no aging)",
        type=int_range(0),
    )


def check_priority(params: SamplingParams) -> None:
    """ValueError naming the field unless `priority` is an integer in PRIORITY_RANGE."""
    p = params.get("priority")
    if isinstance(p, bool) or not isinstance(p, int):
        raise ValueError(f"priority must be an integer, got {p!r}")
    if not PRIORITY_RANGE[0] <= p < PRIORITY_RANGE[1]:
        raise ValueError(f"priority must be in [-2**31, 2**31), got {p}")


class ArrivalQueue(WaitingQueue):
    """Numbers each request when it is first queued; a preempted one keeps its number."""

    def __init__(self, config: SchedulerConfig, cache: KVCacheManager) -> None:
        super().__init__()
        self.cache = cache
        # kept out of Req's fields (the core's), forgotten with the request
        self.arrival: WeakKeyDictionary[Req, int] = WeakKeyDictionary()
        self.num_queued = 0

    def append(self, req: Req) -> None:
        self.arrival[req], self.num_queued = self.num_queued, self.num_queued + 1
        super().append(req)


class PriorityQueue(ArrivalQueue):
    def __init__(self, config: SchedulerConfig, cache: KVCacheManager) -> None:
        super().__init__(config, cache)
        options = config.extras.get("serving")
        if not isinstance(options, PolicyOptions):  # a config built without the extension
            options = PolicyOptions()
        self.aging = options.priority_aging
        self.num_admitted = 0
        self.admitted_before: WeakKeyDictionary[Req, int] = WeakKeyDictionary()

    def append(self, req: Req) -> None:
        self.admitted_before[req] = self.num_admitted
        super().append(req)

    def remove(self, req: Req) -> None:
        super().remove(req)
        if req.table_idx >= 0:  # admitted (a request dropped while waiting holds no row)
            self.num_admitted += 1

    def rank(self, req: Req) -> tuple[float, int]:
        """Lower goes first: the priority, aged by admissions (a request queued after `aging`
        more admissions counts one level lower). A fixed order, so no two requests preempt
        each other back and forth; a request is overtaken only by those queued within `aging`
        admissions after it (per level), and a burst queued at once keeps its priorities however
        long it is (aging by arrivals let the early low ones of a burst of 600 overtake the late
        high ones)."""
        priority, arrival = req.params.get("priority"), self.arrival[req]
        age = self.admitted_before[req]
        return (priority + age / self.aging if self.aging else priority, arrival)

    def first(self) -> Req | None:
        return self.ready(min(self, key=self.rank)) if self else None

    def victim_for(self, req: Req, running: list[Req]) -> Req | None:
        """The running request ranked last, if it ranks after `req`."""
        victim = max(running, key=self.rank, default=None)
        return victim if victim is not None and self.rank(victim) > self.rank(req) else None

    def decode_victim(self, running: list[Req], prefilling: Req | None) -> Req:
        """Of the half-prefilled and the running requests, the one ranked last."""
        return max(running + ([prefilling] if prefilling else []), key=self.rank)


class LongestPrefixQueue(ArrivalQueue):
    def first(self) -> Req | None:
        if not self or len(self) > LPM_MAX_QUEUE:  # ranking them all costs too much
            return super().first()
        prefix = self.cache.prefix_cache.cached_length
        return self.ready(max(self, key=lambda r: (prefix(r.tokens), -self.arrival[r])))
