"""detokenizer / tokenizer worker -> api server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.base import register
from minisgl.message.detokenizer import SchedulerStats


@register
@dataclass
class UserReply:
    """Progress of request `uid`: the text finalised since the previous reply and the tokens that
    produced it. The last reply has finished=True (and `error` set if the request failed)."""

    uid: int
    text_delta: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    completion_tokens: int  # total so far, not just this delta
    error: str | None = None
    # per token of token_ids when asked: [token id, text, logprob, [[id, text, logprob], ...]]
    logprobs: list[list[Any]] | None = None
    # once, with the first reply: the same per prompt token (the first one's logprob is None)
    prompt_logprobs: list[list[Any]] | None = None
    queue_time: float | None = None  # once: seconds in the scheduler's queue
    matched: str | None = None  # the stop string that ended it (finish_reason "stop")
    cached_tokens: int | None = None  # once: prompt tokens the prefix cache supplied


@register
@dataclass
class BatchFrontendMsg:
    msgs: list[UserReply] = field(default_factory=list)
    stats: SchedulerStats | None = None


# ---- between the API processes (--api-server-count > 1) ---------------------------------------
@register
@dataclass
class ApiQueryMsg:
    """API process `rank` -> the others: send me your view (`ApiViewMsg`), for /stats and
    /metrics, which add up what every API process counts."""

    rank: int
    seq: int
    metrics: bool  # with the text of its metrics (/metrics), or only the counts (/stats)


@register
@dataclass
class ApiViewMsg:
    """The answer to `ApiQueryMsg` number `seq`: this process's requests in flight, those not
    started yet, the text of its request-level metrics, and (rank 0) the server's RSS."""

    rank: int
    seq: int
    pid: int
    in_flight: int
    queued: int
    metrics: str
    rss_bytes: int


@register
@dataclass
class ApiFailMsg:
    """The server failed for `reason`: sent by the launcher to the other API processes (end
    every request with this error), or by one of those to rank 0 (its watchdog fired)."""

    reason: str
