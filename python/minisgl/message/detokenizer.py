"""scheduler -> detokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.message.base import register


@register
@dataclass
class DetokenizeMsg:
    """Tokens newly generated for `uid` since the previous message (usually one per step)."""

    uid: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
    error: str | None = None  # why the scheduler refused the request
    # per token: [logprob, top ids, top logprobs] (SamplingParams.logprobs; a tuple before
    # encoding)
    logprobs: list[Sequence[Any]] | None = None
    # once, with the first token: [token id, logprob | None, top ids, top logprobs] per prompt
    # token (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[list[Any]] | None = None
    queue_time: float | None = None  # with the first token: seconds queued before its prefill
    cached_tokens: int | None = None  # with the first token: prompt tokens from the prefix cache


@register
@dataclass
class DetokInitMsg:
    """tokenizer -> detokenizer, before the request reaches the scheduler: what the
    detokenizer needs to turn this request's tokens into text."""

    uid: int
    prompt_len: int
    prompt_tail: list[int]  # the last prompt tokens, context for the first decoded word
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings cannot end the output before this many tokens
    dp_rank: int = 0  # the replica the request went to (where a stop string's abort goes)


@register
@dataclass
class SchedulerStats:
    """A snapshot of the scheduler (rank 0), passed through to the api server."""

    running: int = 0
    waiting: int = 0
    total_pages: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    locked_pages: int = 0
    leaked_pages: int = 0  # owned by neither the allocator, the cache nor a request: a bug
    num_preemptions: int = 0
    prefill_tokens: int = 0  # prompt tokens scheduled so far (re-prefills after preemption too)
    cached_tokens: int = 0  # of those, found in the prefix cache
    counts: dict[str, int] = field(default_factory=dict)  # the extensions' (speculation's)
    dp_rank: int = 0  # the replica (--dp) this snapshot is of


@register
@dataclass
class FlushCacheReply:
    """scheduler -> detokenizer -> api server: the answer to `FlushCacheMsg` of one replica;
    `error` None when its prefix cache is now empty."""

    dp_rank: int
    error: str | None = None
    api_rank: int = 0  # the API process that asked (`FlushCacheMsg.api_rank`)


@register
@dataclass
class BatchDetokenizeMsg:
    """One scheduler step's output for all running requests."""

    msgs: list[DetokenizeMsg] = field(default_factory=list)
    stats: SchedulerStats | None = None
