"""Requests a step feature holds before admission: ext/structured's while their grammar
compiles, ext/lora's until their adapter has a device slot. `Holding.holds` keeps a request in
the feature's `held` list (the core then leaves it out of the planner's queue); at each step's
start rank 0 asks `poll` which to admit (they join the queue) and which end with an error (the
other ranks drop them as aborted). TP followers hold the same requests and admit one when rank
0 says so (`AdmitBackendMsg`, through the `tp_changes` point), at the same step.

While the held requests are the only work, a step waits HOLD_POLL_S after its poll (the
server's loop steps whenever a request is there: neither a hot loop nor a long sleep)."""

from __future__ import annotations

from dataclasses import dataclass
from time import sleep
from typing import Any

from minisgl.core import Req
from minisgl.extension import StepFeature, extensions
from minisgl.message import register

HOLD_POLL_S = 0.02


@register
@dataclass
class AdmitBackendMsg:
    """Rank 0 -> ranks > 0: the request a step feature held is admitted."""

    uid: int


class Holding(StepFeature):
    """A step feature that holds each request it acts on until `poll` releases it."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.held: list[Req] = []  # in arrival order

    def poll(self, held: list[Req]) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Rank 0, without waiting: those to admit now, (request, error) for those that end."""
        return list(held), []

    def holds(self, req: Req) -> bool:
        self.held.append(req)
        return True

    def finished(self, req: Req) -> None:
        if req in self.held:  # aborted, or failed, while held
            self.held.remove(req)

    def admit(self, req: Req) -> None:
        """The request joins the planner's queue (every rank alike)."""
        self.scheduler._tell(AdmitBackendMsg(req.uid))
        self.held.remove(req)
        self.scheduler.planner.waiting.append(req)

    def before_step(self) -> None:
        """Rank 0: admit those `poll` releases, end those that failed."""
        sched = self.scheduler
        if not self.held or sched.follower:  # followers admit at rank 0's word
            return
        ready, failed = self.poll(self.held)
        for req in ready:
            self.admit(req)
        for req, error in failed:
            sched.abort(req.uid, error)
        if self.held and not (sched.planner.busy or sched.pending or sched.in_flight):
            sleep(HOLD_POLL_S)  # only held requests wait: poll again in a while


def follow_admit(scheduler: Any, msg: AdmitBackendMsg) -> None:
    """A TP follower admits the request rank 0 admitted (the `tp_changes` point)."""
    req = scheduler.requests[msg.uid]
    for feature in scheduler.features_of(req):
        if isinstance(feature, Holding) and req in feature.held:
            feature.admit(req)


extensions().tp_changes[AdmitBackendMsg] = follow_admit
