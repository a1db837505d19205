"""tokenizer worker / detokenizer -> scheduler (rank 0)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import SamplingParams
from minisgl.message.base import register


@register
@dataclass
class UserMsg:
    """A tokenised request, ready to schedule."""

    uid: int
    input_ids: list[int]
    params: SamplingParams


@register
@dataclass
class AbortBackendMsg:
    """Stop generating for `uid` and free its cache (client gone, or a stop string was hit)."""

    uid: int


@register
@dataclass
class AdmitBackendMsg:
    """Scheduler rank 0 -> ranks > 0: the held request `uid` (added earlier, held by a step
    feature on every rank: its grammar compiling) joins the waiting queue now: rank 0's
    feature released it."""

    uid: int


@register
@dataclass
class FlushCacheMsg:
    """api server -> scheduler (rank 0, which passes it to the other TP ranks): empty the
    prefix cache, unless requests run (then `FlushCacheReply` says why not)."""

    api_rank: int = 0  # the API process (--api-server-count) that waits for the reply


@register
@dataclass
class ExitMsg:
    """Shut the receiving loop down cleanly."""


@register
@dataclass
class BatchBackendMsg:
    """Several backend messages in one send (fewer wake-ups under load)."""

    msgs: list = field(default_factory=list)
