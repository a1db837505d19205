"""OpenAI's Responses API (/v1/responses, the agent extension) end to end with the official
clients: the `openai` SDK's responses.create (plain, streamed, function calls and their outputs,
previous_response_id, text.format json_schema) and the openai-agents SDK's default Runner with
a function tool. Tool calls and reasoning come from the scripted tiny model
(support/scripted.py: it thinks, calls get_weather, and answers after the tool's result) behind
--tool-call-parser hermes --reasoning-parser qwen3; plain text from a random tiny model. Every
refused field is a 400 naming it."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from minisgl.ext.agent.responses import (
    Responses,
    ResponsesRequest,
    ResponseStore,
    template_kwargs,
)
from minisgl.ext.agent.responses_output import ResponseOutput
from minisgl.server.protocol import APIError, ChatRequest
from support.server import TINY_SERVER, Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")

THINKING = "The user wants the weather in Paris. I will call get_weather."
CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
SCRIPT = f"<think>\n{THINKING}\n</think>\n\n{CALL_TEXT}"
AFTER_THINKING = "The tool said 21 degrees."
ANSWER_TEXT = "It is 21 degrees in Paris."
ANSWER = f"<think>\n{AFTER_THINKING}\n</think>\n\n{ANSWER_TEXT}"
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
QUESTION = "What is the weather in Paris?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius"]}},
        "required": ["city"],
    },
}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def scripted(shared_server: Callable[..., Server]) -> Server:
    # test_tools_http's too (the same script and flags)
    parsers = ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    return shared_server(*parsers, "--served-model-name", "x", script=(SCRIPT, ANSWER))


@pytest.fixture(scope="module")
def tiny(shared_server: Callable[..., Server]) -> Server:
    return shared_server(*TINY_SERVER)


def client_of(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)


def typed(body: dict[str, Any]) -> Response:
    """The response validated against the SDK's type (the SDK itself only constructs it)."""
    return Response.model_validate(body)


def check_usage(usage: Any, reasoning: bool) -> None:
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    reasoning_tokens = usage.output_tokens_details.reasoning_tokens
    assert (0 < reasoning_tokens < usage.output_tokens) if reasoning else reasoning_tokens == 0


def check_call_turn(response: Any) -> Any:
    """The first turn: the reasoning, then one complete get_weather call; the call."""
    assert response.status == "completed" and response.object == "response"
    assert response.id.startswith("resp_") and response.model == "x"
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == [THINKING] and reasoning.summary == []
    assert call.type == "function_call" and call.id.startswith("fc_")
    assert call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and json.loads(call.arguments) == ARGUMENTS
    check_usage(response.usage, reasoning=True)
    return call


def check_answer_turn(response: Any) -> None:
    assert response.status == "completed"
    reasoning, message = response.output
    assert [c.text for c in reasoning.content] == [AFTER_THINKING]
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert [(p.type, p.text, p.annotations) for p in message.content] == [
        ("output_text", ANSWER_TEXT, [])
    ]
    assert response.output_text == ANSWER_TEXT


def test_function_call_and_its_output(scripted: Server) -> None:
    client = client_of(scripted)
    first = client.responses.create(model="x", input=QUESTION, tools=[WEATHER], temperature=0)
    call = check_call_turn(first)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    assert first.temperature == 0 and first.parallel_tool_calls is True and first.store is True
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    history += [item.model_dump(exclude_none=True) for item in first.output]  # reasoning too
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "21 C"})
    second = client.responses.create(model="x", input=history, tools=[WEATHER], temperature=0)
    check_answer_turn(second)
    raw = post(scripted, {"model": "x", "input": history, "tools": [WEATHER], "temperature": 0})
    assert raw.status_code == 200, raw.text
    typed(raw.json())  # every field as the SDK's types have it


def test_previous_response_id_chains_and_get(scripted: Server) -> None:
    client = client_of(scripted)
    first = client.responses.create(
        model="x", input=QUESTION, tools=[WEATHER], temperature=0, instructions="be brief"
    )
    call = check_call_turn(first)
    stored = client.responses.retrieve(first.id)
    assert stored.model_dump() == first.model_dump()
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
    second = client.responses.create(
        model="x",
        input=output,
        previous_response_id=first.id,
        tools=[WEATHER],
        temperature=0,
    )
    check_answer_turn(second)
    assert second.previous_response_id == first.id
    # the chain went into the prompt: the question, the call, its output (not the instructions)
    assert second.usage and first.usage and second.usage.input_tokens > first.usage.input_tokens
    # not stored: not found afterwards, and no base for a chain
    unstored = client.responses.create(model="x", input=QUESTION, store=False, temperature=0)
    r = httpx.get(f"{scripted.url}/v1/responses/{unstored.id}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    r = post(scripted, {"input": "hi", "previous_response_id": unstored.id})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "previous_response_id" and unstored.id in error["message"]


def stream_events(client: OpenAI, **body: Any) -> list[Any]:
    events = list(client.responses.create(stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for e in events:  # each event validates against the SDK's types
        EVENTS.validate_python(e.model_dump())
    return events


def test_streamed_call(scripted: Server) -> None:
    client = client_of(scripted)
    body: dict[str, Any] = dict(model="x", input=QUESTION, tools=[WEATHER], temperature=0)
    events = stream_events(client, **body)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert reasoning == THINKING and json.loads(arguments) == ARGUMENTS
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [d.type for d in done] == ["reasoning", "function_call"]
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args_done.arguments == arguments and args_done.output_index == 1
    # every item's events come between its added and its done
    first_call = kinds.index("response.function_call_arguments.delta")
    assert kinds.index("response.reasoning_text.done") < first_call
    final = events[-1].response
    call = check_call_turn(final)
    assert final.output[1].model_dump() == done[1].model_dump()
    plain = client.responses.create(**body)
    assert call.arguments == plain.output[1].arguments  # same text as the plain answer
    # the SDK's own accumulation of the events gives the same items
    with client.responses.stream(**body) as stream:
        accumulated = stream.get_final_response()
    check_call_turn(accumulated)


def test_openai_agents_runner(scripted: Server) -> None:
    """The openai-agents SDK's default model (the Responses API) with a function tool: the
    agent calls it, sends its result back, and ends with the scripted answer."""
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return "21 degrees"

    async def run() -> Any:
        client = AsyncOpenAI(base_url=f"{scripted.url}/v1", api_key="x", max_retries=0)
        set_default_openai_client(client, use_for_tracing=False)
        set_tracing_disabled(True)
        agent = Agent(
            name="weather",
            instructions="help",
            model="x",
            tools=[get_weather],
            model_settings=ModelSettings(temperature=0),  # the script, token for token
        )
        try:
            return await Runner.run(agent, QUESTION)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls == [("Paris", "celsius")]
    assert result.final_output == ANSWER_TEXT


def test_plain_text_streamed_equals_plain(tiny: Server) -> None:
    client = client_of(tiny)
    body: dict[str, Any] = dict(model="tiny", input="hello world", max_output_tokens=6)
    plain = client.responses.create(temperature=0, **body)
    assert plain.status == "incomplete" and plain.incomplete_details
    assert plain.incomplete_details.reason == "max_output_tokens"
    (message,) = plain.output
    assert message.type == "message" and message.status == "incomplete"
    assert plain.output_text and plain.usage and plain.usage.output_tokens == 6
    check_usage(plain.usage, reasoning=False)
    events = stream_events(client, temperature=0, **body)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    n = sum(e.type == "response.output_text.delta" for e in events)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == text
    # instructions are a system message first: a longer prompt
    told = client.responses.create(temperature=0, instructions="be kind", **body)
    assert told.instructions == "be kind"
    assert told.usage and told.usage.input_tokens > plain.usage.input_tokens


def test_json_schema_format(tiny: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    client = client_of(tiny)
    r = client.responses.create(
        model="tiny", input="hello", text={"format": fmt}, max_output_tokens=64, temperature=0
    )  # type: ignore[arg-type]
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text and r.text.format and r.text.format.type == "json_schema"
    obj = client.responses.create(
        model="tiny", input="hello", text={"format": {"type": "json_object"}}, temperature=0
    )
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"background": True}, "background", "background mode"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "file_search"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", ""),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary", ""),
        ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning effort"),
        ({"truncation": "auto"}, "truncation", ""),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
        ({"conversation": "conv_1"}, "conversation", "conversations"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", ""),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text", "schema"),
        ({"max_output_tokens": 0}, "max_output_tokens", ""),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({"service_tier": "flex"}, "service_tier", ""),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options", ""),
        ({"max_tool_calls": 3}, "max_tool_calls", ""),
        ({"prompt_cache_key": "k"}, "prompt_cache_key", ""),
        ({"safety_identifier": "s"}, "safety_identifier", ""),
        ({"context_management": [{"type": "compaction"}]}, "context_management", ""),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "Unknown parameter"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "image"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
        ({"input": []}, "input", "at least one"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"model": "other"}, "model", "does not exist"),
    ],
)
def test_refused_fields(scripted: Server, extra: dict[str, Any], param: str, words: str) -> None:
    for stream in (False, True):
        r = post(scripted, {"input": "hi", "stream": stream, **extra})
        assert r.status_code == (404 if param == "model" else 400), r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error


def test_off_values_are_accepted(scripted: Server) -> None:
    """Fields given at a value that asks for nothing: accepted."""
    body = {
        "input": "hi",
        "max_output_tokens": 3,
        "background": False,
        "include": [],
        "truncation": "disabled",
        "tools": [],
        "tool_choice": "auto",
        "metadata": {"k": "v"},
        "user": "u",
        "reasoning": {"effort": None, "summary": None},
        "stream_options": {"include_obfuscation": False},
        "top_logprobs": 0,
    }
    r = post(scripted, body)
    assert r.status_code == 200, r.text
    response = typed(r.json())
    assert response.metadata == {"k": "v"} and response.user == "u"


def test_error_after_the_start_is_an_error_event() -> None:
    """A chat stream that fails midway ends the Responses stream with an `error` event (no
    response.completed), the text before it sent."""

    async def chat_stream() -> Any:
        yield 'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
        yield 'data: {"error": {"message": "boom", "param": null, "code": null}}\n\n'

    async def run() -> list[dict[str, Any]]:
        req = ResponsesRequest.model_validate({"input": "hi", "stream": True})
        chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        output = ResponseOutput(req, "m", chat)
        events = Responses(api=None).events(output, chat_stream(), [])  # type: ignore[arg-type]
        text = "".join([e async for e in events])
        return [json.loads(e.split("\ndata: ")[1]) for e in text.strip().split("\n\n")]

    events = asyncio.run(run())
    for e in events:
        EVENTS.validate_python(e)
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["response.output_text.delta", "error"] and events[-2]["delta"] == "Hi"
    assert events[-1]["message"] == "boom"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_store_evicts_the_least_recently_used() -> None:
    store = ResponseStore(size=2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    assert store.get("a") is not None  # now "b" is the least recently used
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") and store.get("c")


def test_reasoning_effort_goes_to_the_template() -> None:
    assert template_kwargs(None, "") is None
    assert template_kwargs("low", "{{ reasoning_effort }}") == {"reasoning_effort": "low"}
    assert template_kwargs("none", "{% if enable_thinking %}") == {"enable_thinking": False}
    with pytest.raises(APIError, match="no reasoning effort"):
        template_kwargs("high", "{{ messages }}")
