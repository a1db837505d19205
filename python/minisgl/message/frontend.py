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


@register
@dataclass
class BatchFrontendMsg:
    msgs: list[UserReply] = field(default_factory=list)
    stats: SchedulerStats | None = None
