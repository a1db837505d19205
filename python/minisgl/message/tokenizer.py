"""api server -> tokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import SamplingParams
from minisgl.message.base import register


@register
@dataclass
class TokenizeMsg:
    """A new request. Exactly one of `text` (raw prompt), `input_ids` (pre-tokenised) or `chat`
    (OpenAI-style messages, rendered with the tokenizer's chat template) is set."""

    uid: int
    text: str | None
    input_ids: list[int] | None
    chat: list[dict] | None
    params: SamplingParams
    skip_special_tokens: bool = True
    chat_template_kwargs: dict | None = None  # extra arguments of apply_chat_template
    tools: list[dict] | None = None  # OpenAI `tools` entries the chat template renders
    # the model's context when the client gave max_tokens: a longer prompt + max_tokens is refused
    context_len: int | None = None
    # the longest prompt + output (tokens): a text too long for it is refused before tokenizing
    max_seq_len: int | None = None
    dp_rank: int | None = None  # the --dp replica it must run on (None: the dispatcher's choice)

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.input_ids, self.chat))
        if given != 1:
            raise ValueError("exactly one of text, input_ids and chat must be given")


@register
@dataclass
class AbortMsg:
    """The client went away (or cancelled): drop request `uid` everywhere."""

    uid: int


@register
@dataclass
class DoneMsg:
    """api server -> tokenizer worker, with --dp > 1: request `uid` has ended, so it no longer
    counts in its replica's load (the dispatcher's)."""

    uid: int
