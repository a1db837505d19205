"""scheduler -> detokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.message.base import register


@register
@dataclass
class DetokenizeMsg:
    """Tokens newly generated for `uid` since the previous message (usually one per step)."""

    uid: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished


@register
@dataclass
class BatchDetokenizeMsg:
    """One scheduler step's output for all running requests."""

    msgs: list[DetokenizeMsg] = field(default_factory=list)
