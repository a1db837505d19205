"""Anthropic messages made of the chat path's answers: a chat completion as a message (thinking,
text and tool_use blocks, stop_reason, usage), and a chat stream, chunk by chunk as it comes, as
Anthropic's events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop)."""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from minisgl.server.api_server import one_line
from minisgl.server.protocol import APIError

_ALPHANUMERIC = string.ascii_letters + string.digits
# the chat stream's error types (OpenAI's) and codes as Anthropic's error types
STREAM_ERROR_TYPES = {
    "timeout": "timeout_error",
    "overloaded": "overloaded_error",
    "server_unavailable": "overloaded_error",
    "server_error": "api_error",
}


@dataclass
class ReplyShape:
    """What a message's answer needs from its request: `omitted` (thinking.display "omitted"):
    thinking blocks come without their text."""

    id: str
    model: str
    max_tokens: int
    omitted: bool = False


def new_message_id() -> str:
    return "msg_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def tool_use_id(call_id: str) -> str:
    """The chat path's call id ("call_...") as Anthropic spells one ("toolu_...")."""
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """A thinking block's `signature`: a digest of its text, not a signature (thinking given back
    is dropped from the prompt, never verified)."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


def thinking_block(thinking: str, shape: ReplyShape) -> dict[str, Any]:
    text = "" if shape.omitted else thinking
    return {"type": "thinking", "thinking": text, "signature": signature(thinking)}


def stop_fields(
    finish: str | None, matched: str | None, output_tokens: int, shape: ReplyShape
) -> dict[str, Any]:
    """stop_reason and stop_sequence of a chat finish_reason (and the stop string matched)."""
    if finish == "tool_calls":
        reason = "tool_use"
    elif finish == "length":  # the context ended it first: Anthropic's own reason for that
        full = output_tokens >= shape.max_tokens
        reason = "max_tokens" if full else "model_context_window_exceeded"
    elif finish == "stop":
        reason = "end_turn" if matched is None else "stop_sequence"
    else:
        raise APIError(500, f"the generation ended without finishing ({finish})")
    return {"stop_reason": reason, "stop_sequence": matched if finish == "stop" else None}


def usage_fields(usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage: input_tokens without the ones read from the prefix cache (when the
    chat usage tells them: cache_read_input_tokens)."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out = {"input_tokens": usage["prompt_tokens"] - (cached or 0)}
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out | {"output_tokens": usage["completion_tokens"]}


def call_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as tool_use input; None when they are not a JSON object (a call cut
    by max_tokens), which is then left out rather than given an input it does not have."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message_head(shape: ReplyShape) -> dict[str, Any]:
    return {"id": shape.id, "type": "message", "role": "assistant", "model": shape.model}


def message_body(chat: dict[str, Any], shape: ReplyShape) -> dict[str, Any]:
    """A chat completion (one choice) as a message: thinking, text, then tool_use blocks."""
    (choice,) = chat["choices"]
    message, content = choice["message"], []
    if message.get("reasoning_content"):
        content.append(thinking_block(message["reasoning_content"], shape))
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        if (given := call_input(function["arguments"])) is not None:
            block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"]}
            content.append(block | {"input": given})
    usage = chat["usage"]
    stop = stop_fields(
        choice["finish_reason"], choice.get("stop_reason"), usage["completion_tokens"], shape
    )
    return message_head(shape) | {"content": content, **stop, "usage": usage_fields(usage)}


def event(kind: str, body: dict[str, Any]) -> str:
    data = one_line(json.dumps({"type": kind, **body}, ensure_ascii=False))
    return f"event: {kind}\ndata: {data}\n\n"


def block_delta(index: int, delta: dict[str, Any]) -> str:
    return event("content_block_delta", {"index": index, "delta": delta})


def error_event(error: dict[str, Any]) -> str:
    """The chat stream's error (OpenAI's shape) as Anthropic's error event."""
    kind = STREAM_ERROR_TYPES.get(error.get("code") or "") or error.get("type")
    kind = STREAM_ERROR_TYPES.get(kind or "", kind or "api_error")
    return event("error", {"error": {"type": kind, "message": error.get("message", "")}})


@dataclass
class Blocks:
    """A streamed message's content blocks, opened and closed as the chat deltas come: a
    thinking block for reasoning, a text block for content, a tool_use block per call."""

    shape: ReplyShape
    index: int = -1  # the open (or last) block's
    kind: str | None = None  # the open block's type
    thinking: str = ""  # the open thinking block's text, for its signature
    calls: dict[int, int] = field(default_factory=dict)  # chat call index -> block index

    def open(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index, self.kind = self.index + 1, block["type"]
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":  # the signature comes last, as Anthropic sends it
            sign = {"type": "signature_delta", "signature": signature(self.thinking)}
            out.append(block_delta(self.index, sign))
        self.kind = None
        return out + [event("content_block_stop", {"index": self.index})]

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out = []
        if text := delta.get("reasoning_content"):
            if self.kind != "thinking":
                out += self.open({"type": "thinking", "thinking": "", "signature": ""})
                self.thinking = ""
            self.thinking += text
            if not self.shape.omitted:
                out.append(block_delta(self.index, {"type": "thinking_delta", "thinking": text}))
        if text := delta.get("content"):
            if self.kind != "text":
                out += self.open({"type": "text", "text": ""})
            out.append(block_delta(self.index, {"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id") is not None:
                name = function.get("name")
                block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": name}
                out += self.open(block | {"input": {}})
                self.calls[call["index"]] = self.index
            if function.get("arguments"):
                json_delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
                out.append(block_delta(self.calls[call["index"]], json_delta))
        return out


def chat_chunks(piece: Any) -> list[dict[str, Any] | None]:
    """The chunks in a piece of the chat stream (whole events); None for its `[DONE]`."""
    text = piece.decode() if isinstance(piece, bytes) else piece
    datas = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
    return [None if d == "[DONE]" else json.loads(d) for d in datas]


async def message_events(response: StreamingResponse, shape: ReplyShape) -> AsyncIterator[str]:
    """The chat stream of `response` as Anthropic's events, each chunk's as it comes.
    message_start's usage counts nothing yet (the chat stream tells the prompt's tokens at its
    end): message_delta carries the counts, input_tokens included."""
    start = message_head(shape) | {"content": [], "stop_reason": None, "stop_sequence": None}
    nothing = {"input_tokens": 0, "output_tokens": 0}
    yield event("message_start", {"message": start | {"usage": nothing}})
    usage = {"prompt_tokens": 0, "completion_tokens": 0}  # the chat stream's, at its end
    blocks, finish, matched = Blocks(shape), None, None
    async with aclosing(response.body_iterator) as chat:  # type: ignore[type-var]
        async for piece in chat:
            out: list[str] = []
            for chunk in chat_chunks(piece):
                if chunk is None:
                    break
                if "error" in chunk:
                    yield "".join(out) + error_event(chunk["error"])
                    return
                for choice in chunk["choices"]:
                    out += blocks.feed(choice.get("delta") or {})
                    finish = choice.get("finish_reason") or finish
                    matched = choice.get("stop_reason") or matched
                usage = chunk.get("usage") or usage
            if out:
                yield "".join(out)
    try:
        stop = stop_fields(finish, matched, usage["completion_tokens"], shape)
    except APIError as e:
        yield error_event({"type": "server_error", "message": e.message})
        return
    tail = blocks.close()
    tail.append(event("message_delta", {"delta": stop, "usage": usage_fields(usage)}))
    yield "".join(tail) + event("message_stop", {})
