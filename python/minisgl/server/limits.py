"""Bounds on the work one request asks for before it is admitted, each refused with a 400 naming
the field: the tokenizer worker, the detokenizer and the grammar compiler serve every request in
turn, so one huge request would hold up all the others. The prompt's own size is bounded by the
tokenizer worker (`minisgl.tokenizer.server.check_prompt_size`), which knows the vocabulary;
the body's by --max-request-bytes. docs/features.md ("Limits") lists them all."""

from __future__ import annotations

from typing import Any

from minisgl.core import CONSTRAINT_KINDS, SamplingParams
from minisgl.server.protocol import APIError

MAX_STOP_STRINGS = 128  # each is searched for in every new piece of text (detokenizer)
MAX_STOP_CHARS = 4096  # per stop string
# json_schema (as JSON text), regex, ebnf or structural_tag: compile time grows faster than the text (a schema
# of 5,000 properties, 230 kB, takes ~2 s with a 480-token vocabulary, longer with real ones)
MAX_GRAMMAR_CHARS = 65536
MAX_MESSAGES = 4096  # chat messages rendered by the template in one request


def check_limits(params: SamplingParams, chat: list[dict[str, Any]] | None) -> None:
    """Refuse a request over one of the limits above (its `params` already checked otherwise)."""
    stop = params.stop if isinstance(params.stop, list) else [params.stop]
    if len(stop) > MAX_STOP_STRINGS:
        message = f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}"
        raise APIError(400, message, "stop", "limit_exceeded")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        message = f"stop: a stop string has at most {MAX_STOP_CHARS} characters, got {longest}"
        raise APIError(400, message, "stop", "limit_exceeded")
    for kind in CONSTRAINT_KINDS:
        text = getattr(params, kind)
        if isinstance(text, str) and len(text) > MAX_GRAMMAR_CHARS:
            message = (
                f"{kind}: at most {MAX_GRAMMAR_CHARS} characters, got {len(text)} "
                "(its compilation would hold up other requests)"
            )
            raise APIError(400, message, kind, "limit_exceeded")
    if chat is not None and len(chat) > MAX_MESSAGES:
        message = f"messages: at most {MAX_MESSAGES} messages, got {len(chat)}"
        raise APIError(400, message, "messages", "limit_exceeded")
