"""A core piece the agent APIs read, without any extension: the stop string that ended a reply
(`UserReply.matched`, set by the detokenizer; the chat's `stop_reason`). The API key in an
`x-api-key` header is the serving extension's (tests/unit/test_gate_unit.py)."""

from __future__ import annotations

from typing import Any

from minisgl.message import DetokenizeMsg, DetokInitMsg, UserReply
from minisgl.tokenizer.detokenize import Detokenizer
from support.tokenizer import build_tiny_tokenizer


class Sent:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def put(self, msg: Any) -> None:
        self.sent.append(msg)


def replies(stop: list[str], finish_reason: str) -> list[UserReply]:
    """The replies to "hello world, hello" fed one token at a time (the last one finishing
    with `finish_reason` unless a stop string ended it first)."""
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("hello world, hello", add_special_tokens=False)
    worker = Detokenizer(tokenizer, Sent(), [Sent()])  # type: ignore[arg-type]
    worker.init(DetokInitMsg(1, 1, [0], stop=stop))
    out = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        reply = worker.guarded(DetokenizeMsg(1, [token], last, finish_reason if last else None))
        if reply is not None:
            out.append(reply)
            if reply.finished:
                break
    return out


def test_matched_stop_string() -> None:
    *first, last = replies(["o w", "orl"], "length")
    assert last.finished and last.finish_reason == "stop" and last.matched == "o w"
    assert all(r.matched is None for r in first)
    assert "".join(r.text_delta for r in [*first, last]) == "hell"


def test_no_stop_string_matched() -> None:
    for reason in ("stop", "length"):  # EOS, max_tokens
        *_, last = replies(["xyz"], reason)
        assert last.finish_reason == reason and last.matched is None
