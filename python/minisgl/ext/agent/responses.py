"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) as one conversion
layer over the chat path: a request becomes a `ChatRequest` (input items -> chat messages,
function tools -> chat tools, text.format -> response_format), `ApiServer.chat_complete` runs
it, and its message (or its stream of chunks, as they come) becomes output items (reasoning,
message, function calls) and the Responses event sequence (`ResponseOutput`).

`store` (default true) keeps each finished response, with the conversation that led to it, in
a bounded in-memory LRU (`ResponseStore`) of this API process, for `previous_response_id` and
`GET`. Every field the API defines is implemented or refused with a 400 naming it; undeclared
fields are refused as OpenAI does (`unknown_parameter`)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field, ValidationError

from minisgl.ext.agent.responses_output import ResponseOutput
from minisgl.ext.serving.api_tokenizer import with_tokenizer
from minisgl.server.protocol import APIError, Body, ChatRequest
from minisgl.tokenizer.server import needed

if TYPE_CHECKING:  # the API server's module is imported where the routes are added
    from minisgl.server.api_server import ApiServer

STORE_SIZE = 256  # responses kept for previous_response_id / GET (least recently used go)

# Responses fields this server cannot honour: a 400 unless given a value that asks for nothing
REFUSED = {
    "background": "background mode",
    "conversation": "conversations (use previous_response_id)",
    "prompt": "prompt templates",
    "include": "extra output data (include)",
    "max_tool_calls": "max_tool_calls (it limits built-in tools only)",
    "top_logprobs": "logprobs",
    "stream_options": "stream options",
    "prompt_cache_key": "prompt_cache_key",
    "prompt_cache_retention": "prompt_cache_retention",
    "safety_identifier": "safety_identifier",
    "service_tier": "service tiers",
    "context_management": "context management",
}
OFF_VALUES: tuple[Any, ...] = (None, False, "", [], 0)


def is_off(value: Any) -> bool:
    """Whether a value asks for nothing: null, false, 0, empty, or an object of such values
    (compared by type first: 0 is not false)."""
    if isinstance(value, dict):
        return all(is_off(v) for v in value.values())
    return any(value is v or (type(value) is type(v) and value == v) for v in OFF_VALUES)


# chat fields that an error of the chat path names -> the Responses field they came from
CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "chat_template_kwargs": "reasoning",
}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class TextFormat(Body):
    """text.format: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: None = None  # no model here takes it: any value is refused (a 400 naming it)


class ReasoningConfig(Body):
    """reasoning: `effort` goes to the chat template (as vLLM: reasoning_effort, and
    enable_thinking off for "none"); summaries cannot be produced (null only)."""

    effort: EFFORTS | None = None
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(Body):
    # undeclared fields are kept to be refused by name (`refuse_extras`)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=2**63)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop old input) is not supported


def refuse_extras(req: ResponsesRequest) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in REFUSED:
            if not is_off(value):
                message = f"{name}: {REFUSED[name]} is not supported"
                raise APIError(400, message, name, "unsupported_parameter")
        else:
            raise APIError(400, f"Unknown parameter: '{name}'.", name, "unknown_parameter")


# ---- input items -> chat messages -------------------------------------------------------------
def _text(value: Any, where: str) -> str:
    """A string, or a list of text parts (input_text / output_text) joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            message = f"{where}[{j}].type: {kind!r} parts are not supported (text only)"
            raise APIError(400, message, "input")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", "input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise APIError(400, f"{where}.{key} must be a string", "input")
    return item[key]


def input_item(item: Any, where: str) -> dict[str, Any] | None:
    """One input (or earlier output) item, checked, in the plain form the store keeps: a message
    with text content, a function call, a function call's output; None for a reasoning item
    (dropped from the prompt, as vLLM does: chat templates drop earlier reasoning too)."""
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object", "input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            message = f"{where}.role: unknown role {role!r} (known: {', '.join(ROLES)})"
            raise APIError(400, message, "input")
        return {
            "type": kind,
            "role": role,
            "content": _text(item.get("content"), where + ".content"),
        }
    if kind == "function_call":
        fields = {k: _string(item, k, where) for k in ("call_id", "name", "arguments")}
        return {"type": kind, **fields}
    if kind == "function_call_output":
        output = _text(item.get("output"), where + ".output")
        return {"type": kind, "call_id": _string(item, "call_id", where), "output": output}
    if kind == "reasoning":
        return None
    raise APIError(400, f"{where}.type: {kind!r} items are not supported", "input")


def input_items(value: str | list[Any]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items = [input_item(item, f"input[{i}]") for i, item in enumerate(value)]
    return [item for item in items if item is not None]


def chat_of(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of checked items: function calls join the assistant message before
    them (or make one), outputs become tool messages naming their call (id and function)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    names: dict[str, str] = {}
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": function}
            names[item["call_id"]] = item["name"]
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            tool = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            if item["call_id"] in names:
                tool["name"] = names[item["call_id"]]
            messages.append(tool)
    return messages


# ---- the other fields -> the chat request's -----------------------------------------------------
def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape; any other tool type (web_search, file_search, mcp...)
    is a 400 naming it."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            message = f"tools[{i}].type: {kind!r} tools are not supported (function tools only)"
            raise APIError(400, message, "tools", "unsupported_parameter")
        if extra := sorted(set(tool) - {"type", "name", "description", "parameters", "strict"}):
            raise APIError(400, f"tools[{i}].{extra[0]} is not supported", "tools")
        converted.append(
            {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        )
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: bool) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            message = f"tool_choice: {choice.get('type')!r} is not supported (function tools only)"
            raise APIError(400, message, "tool_choice", "unsupported_parameter")
        if not isinstance(choice.get("name"), str) or set(choice) != {"type", "name"}:
            raise APIError(400, "tool_choice: give {type: function, name}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("auto", "none") and not tools:
        return None  # asks for nothing without tools
    return choice


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if fmt.name is None or fmt.schema_ is None:
        raise APIError(400, "text.format: json_schema needs a name and a schema", "text")
    spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def template_kwargs(effort: str | None, template: str) -> dict[str, Any] | None:
    """reasoning.effort as the chat template takes it (vLLM's way): `reasoning_effort`, and
    `enable_thinking` (off for "none"); a template with neither cannot honour it (a 400)."""
    if effort is None:
        return None
    kwargs: dict[str, Any] = {}
    if "reasoning_effort" in template:
        kwargs["reasoning_effort"] = effort
    if "enable_thinking" in template:
        kwargs["enable_thinking"] = effort != "none"
    if not kwargs:
        message = "reasoning.effort: this model's chat template takes no reasoning effort"
        raise APIError(400, message, "reasoning", "unsupported_parameter")
    return kwargs


# ---- the store ----------------------------------------------------------------------------------
class ResponseStore:
    """Finished responses with their conversations (the plain items: the chain's inputs and
    outputs), the least recently used dropped beyond `size`."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self.entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        self.entries[response["id"]] = (response, items)
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry


# ---- the endpoint -------------------------------------------------------------------------------
class Responses:
    """/v1/responses over one ApiServer's chat path."""

    def __init__(self, api: ApiServer, store_size: int = STORE_SIZE) -> None:
        self.api = api
        self.store = ResponseStore(store_size)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            message = f"No response with id {response_id!r} is stored here"
            raise APIError(404, message, "response_id", "not_found")
        return entry[0]

    def history(self, previous: str | None) -> list[dict[str, Any]]:
        if previous is None:
            return []
        entry = self.store.get(previous)
        if entry is None:  # never stored here, or evicted (the store keeps the latest only)
            message = f"previous_response_id: no stored response {previous!r} (unknown or evicted)"
            raise APIError(400, message, "previous_response_id", "previous_response_not_found")
        return entry[1]

    async def chat_request(self, req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatRequest:
        messages = chat_of(items, req.instructions)
        if not messages:
            raise APIError(400, "input: give at least one item", "input")
        tools = chat_tools(req.tools)
        body: dict[str, Any] = {
            "model": req.model,
            "messages": messages,
            "stream": req.stream,
            "tools": tools,
            "tool_choice": chat_tool_choice(req.tool_choice, tools is not None),
            "parallel_tool_calls": req.parallel_tool_calls,
            "max_tokens": req.max_output_tokens,
            "response_format": response_format(req.text),
        }
        effort = req.reasoning.effort if req.reasoning is not None else None
        if effort is not None:
            template = await with_tokenizer(self.api, chat_template, "reasoning")
            body["chat_template_kwargs"] = template_kwargs(effort, template)
        body.update(
            {k: getattr(req, k) for k in ("temperature", "top_p") if getattr(req, k) is not None}
        )
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            loc = [str(x) for x in err["loc"]]
            param = CHAT_PARAMS.get(loc[0], loc[0])
            raise APIError(400, f"{'.'.join(loc)}: {err['msg']}", param) from None

    async def create(self, req: ResponsesRequest) -> Any:
        refuse_extras(req)
        items = [*self.history(req.previous_response_id), *input_items(req.input)]
        chat_req = await self.chat_request(req, items)
        output = ResponseOutput(req, self.api.model_name, chat_req)
        try:
            result = await self.api.chat_complete(chat_req)
        except APIError as e:  # named as the client wrote it
            e.param = CHAT_PARAMS.get(e.param or "", e.param)
            raise
        if isinstance(result, StreamingResponse):
            events = self.events(output, result.body_iterator, items)
            return StreamingResponse(events, media_type="text/event-stream")
        (choice,) = result["choices"]
        output.message(choice["message"], choice["finish_reason"])
        return await self.finish(output, result["usage"], items)

    async def finish(
        self, output: ResponseOutput, usage: dict[str, Any], items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The final response (stored if asked), its usage with the reasoning's tokens."""
        output.close_all("completed")  # a stream that ended without a finish_reason
        reasoning = output.reasoning_text()
        count = 0
        if reasoning:  # the tokens of the reasoning text, as the tokenizer encodes it

            def encode(tokenizer: Any) -> int:
                return len(needed(tokenizer).encode(reasoning, add_special_tokens=False))

            count = min(await with_tokenizer(self.api, encode, "input"), usage["completion_tokens"])
        response = output.response(usage, count)
        if output.req.store:
            plain = [input_item(item, "output") for item in response["output"]]
            self.store.put(response, [*items, *(i for i in plain if i is not None)])
        return response

    async def events(
        self, output: ResponseOutput, chunks: Any, items: list[dict[str, Any]]
    ) -> AsyncIterator[str]:
        """The Responses event sequence, re-emitted as the chat chunks arrive."""
        yield output.start()
        usage: dict[str, Any] = {}
        async with aclosing(chunks) as stream:  # the chat path's generator: closed, it aborts
            async for text in stream:
                for body in chat_events(text):
                    if "error" in body:  # the client sees an error, not a cut answer
                        yield output.error(body["error"])
                        return
                    usage = body.get("usage") or usage
                    for choice in body.get("choices", []):
                        output.delta(choice["delta"], choice.get("finish_reason"))
                if events := output.take():
                    yield events
        try:
            response = await self.finish(output, usage, items)
        except APIError as e:
            yield output.error({"message": e.message, "param": e.param, "code": e.code})
            return
        yield output.end(response)


def chat_events(text: Any) -> list[dict[str, Any]]:
    """The JSON bodies of the chat path's SSE text (one or more `data:` events)."""
    text = text.decode() if isinstance(text, bytes) else text
    return [
        json.loads(event[6:])
        for event in text.split("\n\n")
        if event.startswith("data: ") and event != "data: [DONE]"
    ]


def chat_template(tokenizer: Any) -> str:
    template = getattr(needed(tokenizer), "chat_template", None) or ""
    return template if isinstance(template, str) else " ".join(template.values())


def add_routes(app: Any, api: ApiServer, info: dict[str, Any]) -> None:
    from minisgl.ext.serving.disconnect import unless_disconnected

    responses = Responses(api)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request) -> Any:
        return await unless_disconnected(request, responses.create(req))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Any:
        return responses.retrieve(response_id)
