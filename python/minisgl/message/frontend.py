"""detokenizer / tokenizer worker -> api server."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@register
@dataclass
class BatchFrontendMsg:
    msgs: list[UserReply] = field(default_factory=list)
    stats: SchedulerStats | None = None
