"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as one
conversion layer over the chat path: a request becomes a `ChatRequest` (system, content blocks,
tools, tool_choice, thinking, sampling) that `ApiServer.chat_complete` serves; its answer (or
its stream of chat chunks, as they come) becomes a message with thinking, text and tool_use
blocks (`messages_reply`). Every error on these paths is in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, ValidationError

from minisgl.ext.agent.messages_reply import (
    ReplyShape,
    message_body,
    message_events,
    new_message_id,
)
from minisgl.ext.serving.disconnect import unless_disconnected
from minisgl.ext.serving.tokenize import TokenizeRequest, tokenize
from minisgl.ext.structured.options import chat_options
from minisgl.extension import extensions
from minisgl.server.api_server import ApiServer
from minisgl.server.protocol import APIError, Body, ChatRequest

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by HTTP status (others: api_error at 5xx, invalid_request_error below)
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
# request fields of Anthropic's API this server does not implement: a 400 naming them
NOT_SUPPORTED = {
    "container": "containers (server-side code execution)",
    "mcp_servers": "MCP servers",
    "context_management": "context management",
    "inference_geo": "inference regions",
    "speed": "speed modes",
    "diagnostics": "diagnostics",
}
# tool fields that are not the client tool's name, description, input_schema (cache_control:
# accepted, prefix caching is automatic here)
TOOL_FIELDS = {"name", "description", "input_schema", "type", "cache_control"}
# fields each input content block may carry besides its own (cache_control: as for tools)
BLOCK_FIELDS = {
    "text": {"type", "text", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}
# the blocks each role's messages may hold (thinking given back: dropped)
ROLE_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
IS_ERROR_PREFIX = "Error: "  # how a tool_result with is_error reads to the model


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Anthropic's error object (`param` and `code` have no place in it)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_json(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message), e.status, headers=e.headers)


class Metadata(Body):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None  # accepted: it changes nothing this server computes


class Thinking(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class ToolChoice(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    effort: None = None  # a reasoning effort: not supported (only null is taken)


class MessagesInput(Body):
    """What makes a prompt (all that count_tokens takes)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # accepted: prefix caching is automatic


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1, lt=2**63)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, lt=2**63)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: either holds
    stream: bool = False


def refuse(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def check_fields(req: MessagesInput) -> None:
    """Refuse the undeclared fields: Anthropic's that this server lacks, and unknown ones."""
    for name, value in (req.model_extra or {}).items():
        if value is None:
            continue
        if name in NOT_SUPPORTED:
            raise refuse(name, f"{NOT_SUPPORTED[name]} are not supported")
        raise refuse(name, "unknown field")


def unknown_keys(block: dict[str, Any], allowed: set[str], where: str) -> None:
    """A 400 for a block's field that is neither known nor null."""
    for key, value in block.items():
        if key not in allowed and value is not None:
            raise refuse(f"{where}.{key}", "unknown or unsupported field")


def text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (system, tool_result content)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise refuse(where, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise refuse(
                f"{where}[{j}].type", f"{kind!r} blocks are not supported here (text only)"
            )
        unknown_keys(block, BLOCK_FIELDS["text"], f"{where}[{j}]")
        if not isinstance(block.get("text"), str):
            raise refuse(f"{where}[{j}].text", "must be a string")
        texts.append(block["text"])
    return "\n".join(texts)


def tool_message(block: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    """A tool_result block as the chat path's tool message (its call's name where known)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise refuse(f"{where}.tool_use_id", "must be a string")
    text = "" if block.get("content") is None else text_of(block["content"], f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise refuse(f"{where}.is_error", "must be a boolean")
    message = {"role": "tool", "tool_call_id": call_id}
    message["content"] = IS_ERROR_PREFIX + text if is_error else text
    if call_id in names:
        message["name"] = names[call_id]
    return message


def history_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier tool_use block as the chat path's assistant tool call."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise refuse(where, "a tool_use block needs a string id and name")
    if not isinstance(block.get("input"), dict):
        raise refuse(f"{where}.input", "must be an object")
    function = {"name": block["name"], "arguments": block["input"]}
    return {"id": block["id"], "type": "function", "function": function}


def turn(role: str, blocks: list[Any], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool_result blocks are tool
    messages (its text around them user messages, in order); an assistant turn's tool_use
    blocks its tool calls; thinking given back is dropped (the template shows no earlier
    thinking)."""
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind: Any = block.get("type") if isinstance(block, dict) else None
        if kind not in ROLE_BLOCKS[role]:
            why = "(these models read text only)" if kind in MEDIA_BLOCKS else f"in {role} messages"
            raise refuse(f"{at}.type", f"{kind!r} blocks are not supported {why}")
        if kind in ("thinking", "redacted_thinking"):
            continue
        unknown_keys(block, BLOCK_FIELDS[kind], at)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise refuse(f"{at}.text", "must be a string")
            texts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            calls.append(history_call(block, at))
            names[block["id"]] = block["name"]
        else:
            if texts:  # text before a result stays before it
                out.append({"role": "user", "content": texts})
                texts = []
            out.append(tool_message(block, at, names))
    if role == "assistant":
        out.append({"role": "assistant", "content": texts, "tool_calls": calls or None})
    elif texts:
        out.append({"role": "user", "content": texts})
    return out


def chat_history(req: MessagesInput) -> list[dict[str, Any]]:
    """The system prompt and the messages as the chat path's messages."""
    chat: list[dict[str, Any]] = []
    if req.system is not None:
        chat.append({"role": "system", "content": text_of(req.system, "system")})
    names: dict[str, str] = {}  # tool_use id -> its tool's name, for the results
    for i, given in enumerate(req.messages):
        where = f"messages[{i}]"
        unknown_keys(given, {"role", "content"}, where)
        role, content = given.get("role"), given.get("content")
        if role not in ("user", "assistant"):
            raise refuse(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise refuse(f"{where}.content", "must be a string or a list of content blocks")
        chat += turn(role, content, where, names)
    if req.messages[-1].get("role") == "assistant":
        where = f"messages[{len(req.messages) - 1}]"
        message = "a final assistant message (prefill) is not supported: end with a user turn"
        raise refuse(where, message)
    return chat


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Client tools as the chat path's functions; server tools (web_search, bash...) refused."""
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind not in (None, "custom"):
            message = f"{kind!r}: server tools are not supported (client tools only)"
            raise refuse(f"{where}.type", message)
        unknown_keys(tool, TOOL_FIELDS, where)
        if "input_schema" not in tool:
            raise refuse(f"{where}.input_schema", "is required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    return functions


def tool_choice_fields(choice: ToolChoice | None) -> dict[str, Any]:
    """tool_choice and parallel_tool_calls of the chat request."""
    if choice is None:
        return {}
    if (choice.type == "tool") != (choice.name is not None):
        raise refuse("tool_choice.name", "is required with type 'tool' and only with it")
    if choice.type == "none" and choice.disable_parallel_tool_use is not None:
        raise refuse("tool_choice.disable_parallel_tool_use", "has no meaning with type 'none'")
    named = {"type": "function", "function": {"name": choice.name}}
    fields: dict[str, Any] = {
        "tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, named)
    }
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def template_kwargs(req: MessagesInput, api: ApiServer, max_tokens: int | None) -> dict | None:
    """`thinking` as the chat template's enable_thinking (Qwen3's switch). "enabled" and
    "adaptive" need the reasoning parser (the thinking comes back as thinking blocks); a budget
    below max_tokens could bind, which this server cannot enforce: refused."""
    thinking = req.thinking
    if thinking is None:
        return None
    if thinking.type == "disabled":
        if thinking.budget_tokens is not None or thinking.display is not None:
            raise refuse("thinking", "budget_tokens and display go with type 'enabled'")
        return {"enable_thinking": False}
    if chat_options(api.args).reasoning_parser is None:
        message = "needs a server started with --reasoning-parser (to return thinking blocks)"
        raise refuse("thinking", message)
    budget = thinking.budget_tokens
    if thinking.type == "adaptive" and budget is not None:
        raise refuse("thinking.budget_tokens", "goes with type 'enabled' only")
    if thinking.type == "enabled":
        if budget is None or budget < MIN_THINKING_BUDGET:
            raise refuse("thinking.budget_tokens", f"must be at least {MIN_THINKING_BUDGET}")
        if max_tokens is not None and budget < max_tokens:
            message = (
                f"a thinking budget below max_tokens ({max_tokens}) cannot be enforced by this "
                "server: give budget_tokens >= max_tokens, or type 'adaptive' (the model "
                "decides how long to think, within max_tokens)"
            )
            raise refuse("thinking.budget_tokens", message)
    return {"enable_thinking": True}


def prompt_fields(req: MessagesInput, api: ApiServer, max_tokens: int | None) -> dict[str, Any]:
    """The chat request's fields that make its prompt (count_tokens renders the same)."""
    fields: dict[str, Any] = {"model": req.model, "messages": chat_history(req)}
    if req.tools is not None:
        fields["tools"] = chat_tools(req.tools)
    kwargs = template_kwargs(req, api, max_tokens)
    if kwargs is not None:
        fields["chat_template_kwargs"] = kwargs
    return fields


def chat_request(req: MessagesRequest, api: ApiServer) -> ChatRequest:
    """The chat request that serves `req`."""
    check_fields(req)
    fields = prompt_fields(req, api, req.max_tokens)
    fields |= tool_choice_fields(req.tool_choice)
    fields |= {"max_tokens": req.max_tokens, "stream": req.stream, "stop": req.stop_sequences}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.output_config is not None and req.output_config.format is not None:
        schema = {"name": "output", "schema": req.output_config.format.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.stream:  # the usage comes at the end of the chat stream
        fields["stream_options"] = {"include_usage": True}
    return ChatRequest.model_validate(fields)


def parse(model: type[MessagesInput], raw: bytes) -> Any:
    """The request body as `model`, or Anthropic's 400 naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, "request body is not valid JSON") from None
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        raise refuse(loc, err["msg"]) from None


async def create(api: ApiServer, req: MessagesRequest) -> Any:
    """A message, whole or as Anthropic's server-sent events."""
    chat = chat_request(req, api)
    omitted = req.thinking is not None and req.thinking.display == "omitted"
    shape = ReplyShape(new_message_id(), req.model, req.max_tokens, omitted)
    result = await api.chat_complete(chat)
    if isinstance(result, StreamingResponse):
        events = message_events(result, shape)
        return StreamingResponse(events, media_type="text/event-stream")
    return message_body(result, shape)


async def count_tokens(api: ApiServer, req: MessagesInput) -> dict[str, int]:
    """input_tokens of a request: its prompt rendered (tools too) and tokenized."""
    check_fields(req)
    request = TokenizeRequest.model_validate(prompt_fields(req, api, None))
    tokenized = await tokenize(api, request)  # vLLM's /tokenize (the serving extension's)
    return {"input_tokens": tokenized["count"]}


async def answered(request: Request, work: Callable[[bytes], Awaitable[Any]]) -> Response:
    """`work`'s answer to the body, every error in Anthropic's shape."""
    try:
        result = await unless_disconnected(request, work(await request.body()))
    except APIError as e:
        return error_json(e)
    return result if isinstance(result, Response) else JSONResponse(result)


def add_routes(app: FastAPI, api: ApiServer, info: dict[str, Any]) -> None:
    # the Gate's refusals here (a wrong x-api-key...) in Anthropic's shape too
    extensions().error_bodies.update({path: error_body for path in PATHS})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await answered(request, lambda raw: create(api, parse(MessagesRequest, raw)))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await answered(request, lambda raw: count_tokens(api, parse(MessagesInput, raw)))
