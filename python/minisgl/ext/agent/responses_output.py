"""A Responses API response as the chat path's answer arrives: its output items (reasoning,
message, function calls) and the event sequence that streams them, built by one state machine
(`ResponseOutput`) for both the streamed answer (chat deltas, one by one) and the plain one (the
whole message as one delta, its events dropped)."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from minisgl.server.api_server import one_line

if TYPE_CHECKING:
    from minisgl.ext.agent.responses import ResponsesRequest
    from minisgl.server.protocol import ChatRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(body: dict[str, Any]) -> str:
    return f"event: {body['type']}\ndata: {one_line(json.dumps(body, ensure_ascii=False))}\n\n"


class ResponseOutput:
    """One response's items and events. An item is open while its text arrives (`open`: the
    reasoning or message item, or a chat call index -> its function_call item); the next kind of
    text, or the end, closes it (its .done events)."""

    def __init__(self, req: ResponsesRequest, model: str, chat: ChatRequest) -> None:
        self.req, self.model, self.chat = req, model, chat
        self.id, self.created_at = new_id("resp"), int(time.time())
        self.items: list[dict[str, Any]] = []
        self.index: dict[str, int] = {}  # item id -> its output_index
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.calls: dict[int, dict[str, Any]] = {}  # chat call index -> its open item
        self.finish_reason: str | None = None
        self.seq = 0
        self.pending: list[str] = []

    # ---- events ----
    def emit(self, kind: str, **fields: Any) -> None:
        self.pending.append(sse_event({"type": kind, "sequence_number": self.seq, **fields}))
        self.seq += 1

    def take(self) -> str:
        out, self.pending = "".join(self.pending), []
        return out

    def start(self) -> str:
        response = self.response(None, 0, "in_progress")
        self.emit("response.created", response=response)
        self.emit("response.in_progress", response=response)
        return self.take()

    def end(self, response: dict[str, Any]) -> str:
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        self.emit(kind, response=response)
        return self.take()

    def error(self, error: dict[str, Any]) -> str:
        fields = {k: error.get(k) for k in ("code", "message", "param")}
        self.emit("error", **fields)
        return self.take()

    # ---- items ----
    def add(self, item: dict[str, Any]) -> None:
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        self.emit("response.output_item.added", output_index=self.index[item["id"]], item=item)

    def where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}

    def text(self, kind: str, piece: str) -> None:
        """Reasoning (`kind` "reasoning") or message text: into the open item of that kind."""
        if not piece:
            return
        if self.open is None or self.open["type"] != kind:
            self.close_all("completed")
            item: dict[str, Any]
            part: dict[str, Any]
            if kind == "reasoning":
                item = {"id": new_id("rs"), "type": kind, "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": new_id("msg"), "type": kind, "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["status"] = "in_progress"
            self.add(item)
            item["content"].append(part)
            self.emit("response.content_part.added", **self.where(item), content_index=0, part=part)
            self.open = item
        part = self.open["content"][0]
        part["text"] += piece
        delta = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        self.emit(delta, **self.where(self.open), content_index=0, delta=piece, **extra)

    def call(self, piece: dict[str, Any]) -> None:
        """A chat tool call's piece: its first (id and name) opens a function_call item."""
        function = piece.get("function") or {}
        item = self.calls.get(piece.get("index", 0))
        if item is None:
            self.close_all("completed")
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": piece.get("id") or new_id("call"),  # a parser's pieces carry it
                "name": function.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            self.add(item)
            self.calls[piece.get("index", 0)] = item
        if arguments := function.get("arguments"):
            item["arguments"] += arguments
            self.emit("response.function_call_arguments.delta", **self.where(item), delta=arguments)

    def close(self, item: dict[str, Any], status: str) -> None:
        where = self.where(item)
        if item["type"] == "function_call":
            arguments = item["arguments"]
            self.emit("response.function_call_arguments.done", **where, arguments=arguments)
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                self.emit(
                    "response.reasoning_text.done", **where, content_index=0, text=part["text"]
                )
            else:
                done = {"text": part["text"], "logprobs": []}
                self.emit("response.output_text.done", **where, content_index=0, **done)
            self.emit("response.content_part.done", **where, content_index=0, part=part)
        item["status"] = status
        self.emit("response.output_item.done", output_index=where["output_index"], item=item)

    def close_all(self, status: str) -> None:
        for item in [self.open, *self.calls.values()]:
            if item is not None:
                self.close(item, status)
        self.open, self.calls = None, {}

    # ---- the chat answer ----
    def delta(self, delta: dict[str, Any], finish_reason: str | None) -> None:
        """One chat stream delta (the last: finish_reason set, which closes every item)."""
        self.text("reasoning", delta.get("reasoning_content") or "")
        self.text("message", delta.get("content") or "")
        for piece in delta.get("tool_calls") or []:
            self.call(piece)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            # a cut answer's last item is incomplete
            self.close_all("incomplete" if finish_reason == "length" else "completed")

    def message(self, message: dict[str, Any], finish_reason: str | None) -> None:
        """A whole chat message: one delta whose calls come whole; no events."""
        calls = [{"index": i, **c} for i, c in enumerate(message.get("tool_calls") or [])]
        self.delta({**message, "tool_calls": calls}, finish_reason or "stop")
        self.take()

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def response(
        self, usage: dict[str, Any] | None, reasoning_tokens: int, status: str | None = None
    ) -> dict[str, Any]:
        """The response object; `usage`: the chat path's (None while in progress)."""
        if status is None:
            status = "incomplete" if self.finish_reason == "length" else "completed"
        req, chat = self.req, self.chat
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": self.items if usage is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": None,
            },
            "store": req.store,
            "temperature": chat.temperature,
            "text": {"format": text_format(req)},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": chat.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else response_usage(usage, reasoning_tokens),
            "user": req.user,
        }
        if status == "completed":
            body["completed_at"] = int(time.time())
        return body


def text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def response_usage(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """The chat usage as the Responses API counts it (cached: the chat's prompt_tokens_details
    where the chat path reports it; cache_write_tokens, which the SDK's type requires, counts
    OpenAI's explicit prompt-cache writes: none here)."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }
