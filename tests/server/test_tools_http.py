"""Tool calling and reasoning end to end: a server with `--tool-call-parser hermes
--reasoning-parser qwen3` on the scripted tiny model (support/scripted.py), whose greedy answer
thinks and then calls get_weather, and answers after the tool's result; through the official
openai client, streamed and not; forced calls and response_format after free reasoning; and the
refusals. Then a random tiny model without any parser flag (auto picks hermes and qwen3 from its
template, and says so at start): forced calls sampled at temperature 0.8 always validate against
their schemas, a named one is exactly one call whose arguments are the whole answer, and a
forced call cut by max_tokens ends "length" without a call that looks complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from support.server import REPO, Server, run_server
from support.tool_model import FORECAST, SCHEMAS, make_random_tool_model
from support.tool_model import TOOLS as RANDOM_TOOLS

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")

THINKING = "The user wants the weather in Paris. I will call get_weather."
CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
SCRIPT = f"<think>\n{THINKING}\n</think>\n\n{CALL_TEXT}"
ANSWER = "<think>\nThe tool said 21 degrees.\n</think>\n\nIt is 21 degrees in Paris."
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
CHAT: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius"]}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    # test_responses_http's too (the same script and flags)
    parsers = ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    return shared_server(*parsers, "--served-model-name", "x", script=(SCRIPT, ANSWER))


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def create(client: OpenAI, **body: Any) -> Any:
    """A greedy chat completion (typed loosely: the client's types are TypedDicts)."""
    return client.chat.completions.create(model="x", temperature=0, **body)


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS


def test_call_with_reasoning(client: OpenAI) -> None:
    r = create(client, messages=CHAT, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    assert message.reasoning_content == THINKING
    (call,) = message.tool_calls or []
    check_call(call)


def test_streamed_call_with_reasoning(client: OpenAI) -> None:
    stream = create(
        client,
        messages=CHAT,
        tools=TOOLS,
        stream=True,
        logprobs=True,
    )
    content, reasoning, reasons, logprobs = "", "", [], 0
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        (choice,) = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert call["id"] is None  # id and name come once, first
                call["id"], call["name"] = piece.id, piece.function.name
            else:
                assert call["id"] is not None  # arguments follow the id
            call["arguments"] += (piece.function and piece.function.arguments) or ""
        reasons.append(choice.finish_reason)
        logprobs += len(choice.logprobs.content or []) if choice.logprobs else 0
    assert content == "" and reasoning == THINKING
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == ARGUMENTS
    assert logprobs > 0  # every token's logprob still comes, whatever the parser withholds


def test_tool_choice_none_returns_the_text(client: OpenAI, server: Server) -> None:
    r = create(
        client,
        messages=CHAT,
        tools=TOOLS,
        tool_choice="none",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == CALL_TEXT  # not parsed; the reasoning still is
    assert choice.message.reasoning_content == THINKING
    # the tools were rendered into the prompt all the same
    plain = create(client, messages=CHAT)
    assert r.usage and plain.usage and r.usage.prompt_tokens > plain.usage.prompt_tokens
    tokenized = [
        httpx.post(f"{server.url}/tokenize", json={"messages": CHAT, **extra}).json()["count"]
        for extra in ({"tools": TOOLS}, {})
    ]
    assert tokenized == [r.usage.prompt_tokens, plain.usage.prompt_tokens]


@pytest.mark.parametrize("first_choice", ["auto", "required"])
def test_agent_loop(client: OpenAI, first_choice: str) -> None:
    """call -> the tool's result -> the final answer, with the call sent back in the history."""
    messages: list[Any] = list(CHAT)
    first = create(client, messages=messages, tools=TOOLS, tool_choice=first_choice)
    call = (first.choices[0].message.tool_calls or [])[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "21 C"})
    final = create(client, messages=messages, tools=TOOLS)
    choice = final.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "It is 21 degrees in Paris."
    assert choice.message.reasoning_content == "The tool said 21 degrees."


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a function whose forced-call grammar is over the server's limit on grammar text (65,536)
HUGE = {
    "type": "function",
    "function": {
        "name": "huge",
        "parameters": {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(3000)},
        },
    },
}


@pytest.mark.parametrize(
    "choice", [{"tool_choice": "required"}, {"tool_choice": NAMED}, {"function_call": NAMED}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_after_reasoning(client: OpenAI, choice: dict[str, Any], stream: bool) -> None:
    """The grammar of a forced call lets the reasoning through, then takes the model's call;
    a legacy `functions` request gets the legacy reply (`function_call`)."""
    body: dict[str, Any] = dict(messages=CHAT, stream=stream, max_tokens=200)
    legacy = "function_call" in choice
    if legacy:
        body.update(
            functions=[WEATHER["function"]], function_call=choice["function_call"]["function"]
        )
    else:
        body.update(tools=TOOLS, tool_choice=choice["tool_choice"])
    if not stream:
        r = create(client, **body).choices[0]
        message = r.message
        assert message.reasoning_content == THINKING and message.content is None
        if legacy:
            assert message.tool_calls is None and r.finish_reason == "function_call"
            function = message.function_call
            assert function is not None and function.name == "get_weather"
            assert json.loads(function.arguments) == ARGUMENTS
            return
        (call,) = message.tool_calls or []
        check_call(call)
        assert r.finish_reason == "tool_calls"
        return
    reasoning, arguments, names, reasons = "", "", [], []
    for chunk in create(client, **body):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert not delta.content
        assert not (legacy and delta.tool_calls)
        pieces = [delta.function_call] if legacy and delta.function_call else delta.tool_calls
        for piece in pieces or []:
            function = getattr(piece, "function", piece)
            names += [function.name] if function and function.name else []
            arguments += (function and function.arguments) or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert names == ["get_weather"] and reasoning == THINKING
    assert reasons[-1] == ("function_call" if legacy else "tool_calls")
    assert json.loads(arguments) == ARGUMENTS


def test_response_format_after_reasoning(client: OpenAI) -> None:
    """The script's thinking comes through; the answer (a call in the script) must be JSON."""
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "kelvin"]}},
        "required": ["unit"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "unit", "schema": schema}}
    r = create(client, messages=CHAT, response_format=fmt, max_tokens=150)
    message = r.choices[0].message
    assert message.reasoning_content == THINKING  # not constrained: the script's
    jsonschema.validate(json.loads(message.content or ""), schema)
    assert r.choices[0].finish_reason == "stop"


def test_structural_tag_field(server: Server) -> None:
    """SGLang's structural_tag sampling parameter (the grammar kind forced calls use)."""
    fmt = {"type": "structural_tag", "format": {"type": "const_string", "value": "yes, 21 C"}}
    params = {"structural_tag": fmt, "max_new_tokens": 40}
    r = httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": params})
    assert r.status_code == 200 and r.json()["text"] == "yes, 21 C", r.text
    params["structural_tag"] = {"type": "structural_tag", "format": {"type": "nope"}}
    r = httpx.post(f"{server.url}/generate", json={"text": "hi", "sampling_params": params})
    assert r.status_code == 400 and "invalid structural_tag" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among the given tools",
        ),
        (
            {"functions": [WEATHER["function"]], "function_call": {"name": "nope"}},
            "function_call.name",
            "not among the given tools",
        ),
        ({"tools": [HUGE], "tool_choice": "required"}, "tools", "grammar of the forced calls"),
        (
            {
                "functions": [WEATHER["function"]],
                "function_call": {"name": "get_weather"},
                "regex": "x",
            },
            "function_call",
            "cannot be combined with another output constraint (regex)",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined with another output constraint",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
            "JSON schema",
        ),
        ({"functions": [{"name": "f"}], "tools": TOOLS}, "functions", "not both"),
        ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call", "one of"),
    ],
)
def test_refusals(server: Server, extra: dict[str, Any], param: str, words: str) -> None:
    r = post(server, {"messages": CHAT, "max_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_history_refusals(server: Server) -> None:
    bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [bad]}]
    r = post(server, {"messages": history, "max_tokens": 1})
    assert r.status_code == 400 and "arguments: not valid JSON" in r.json()["error"]["message"]
    r = post(server, {"messages": [{"role": "user", "content": "x", "tool_calls": [bad]}]})
    assert r.status_code == 400 and "only assistant" in r.json()["error"]["message"]
    # what cannot travel to the tokenizer worker (msgpack) is the client's error, not a 500
    huge = {**bad, "function": {"name": "f", "arguments": '{"n": 123456789012345678901234567}'}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [huge]}]
    r = post(server, {"messages": history, "max_tokens": 1})
    assert r.status_code == 400 and "64 bits" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "flag, names", [("--tool-call-parser", "hermes"), ("--reasoning-parser", "qwen3")]
)
def test_unknown_parser_at_start(flag: str, names: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    cmd = [sys.executable, "-m", "minisgl", flag, "nope"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"argument {flag}: invalid choice: 'nope'" in done.stderr and names in done.stderr


# ---- forced calls on a random tiny model: sampled noise, yet always valid calls -------------
@pytest.fixture(scope="module")
def random_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    model = make_random_tool_model(str(tmp_path_factory.mktemp("random_tools")))
    log = str(tmp_path_factory.mktemp("logs") / "random.log")
    with run_server(model, "--served-model-name", "x", log_path=log) as s:  # parsers: auto
        with open(log) as f:
            said = f.read()
        assert "--tool-call-parser auto: hermes (the chat template has '<tool_call>')" in said
        assert "--reasoning-parser auto: qwen3 (the chat template has <think>)" in said
        yield OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)


def plan_trip(client: OpenAI, **body: Any) -> Any:
    """Three samples at temperature 0.8 (seeded) of a chat with RANDOM_TOOLS, thinking off."""
    return client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Plan my trip."}],
        tools=RANDOM_TOOLS,
        temperature=0.8,
        seed=0,
        n=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **body,
    )


def sampled_calls(client: OpenAI, stream: bool, **body: Any) -> list[list[dict[str, Any]]]:
    """Each choice's calls, sampled at temperature 0.8 with thinking off (the template closes
    an empty block: the grammar holds from the first token), streamed or not; every call's
    arguments valid against its function's schema."""
    r = plan_trip(client, max_tokens=600, stream=stream, **body)
    choices = collect_stream(r) if stream else [c.model_dump() for c in r.choices]
    result = []
    for choice in choices:
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls", message
        assert message["content"] is None and message.get("reasoning_content") is None
        for call in message["tool_calls"]:
            function = call["function"]
            jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])
        result.append(message["tool_calls"])
    return result


def collect_stream(stream: Any) -> list[dict[str, Any]]:
    """The choices of a streamed response, put together as whole messages."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"message": {"content": None, "tool_calls": []}})
            message, delta = choice["message"], c.delta
            if delta.content:
                message["content"] = (message["content"] or "") + delta.content
            if getattr(delta, "reasoning_content", None):
                message["reasoning_content"] = delta.reasoning_content
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    function = {"name": piece.function.name, "arguments": ""}
                    message["tool_calls"].append({"id": piece.id, "function": function})
                call = message["tool_calls"][piece.index]
                call["function"]["arguments"] += piece.function.arguments or ""
            choice["finish_reason"] = c.finish_reason
    return [choices[i] for i in sorted(choices)]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_validate(random_client: OpenAI, stream: bool) -> None:
    required = sampled_calls(random_client, stream, tool_choice="required")
    assert all(calls for calls in required)
    assert len({json.dumps(calls) for calls in required}) > 1  # sampled, not greedy
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = sampled_calls(random_client, stream, tool_choice=named)
    assert {call["function"]["name"] for calls in forced for call in calls} == {"get_time"}
    single = sampled_calls(random_client, stream, tool_choice="required", parallel_tool_calls=False)
    assert [len(calls) for calls in single] == [1, 1, 1]


def test_free_sampling_makes_no_call(random_client: OpenAI) -> None:
    """The same requests under tool_choice auto: noise, no call (the grammar is what works)."""
    r = plan_trip(random_client, max_tokens=60)
    assert all(not c.message.tool_calls for c in r.choices)


def test_response_format_with_thinking_off(random_client: OpenAI) -> None:
    """Thinking off: the JSON constraint holds from the first token (no reasoning at all)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
    r = random_client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Plan my trip."}],
        temperature=0.8,
        seed=1,
        n=3,
        max_tokens=200,
        response_format=fmt,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    for choice in r.choices:
        assert getattr(choice.message, "reasoning_content", None) is None
        jsonschema.validate(json.loads(choice.message.content or ""), FORECAST)


@pytest.mark.parametrize("stream", [False, True])
def test_named_call_is_one_schema_valid_call(random_client: OpenAI, stream: bool) -> None:
    """Named, three seeds: exactly one call of that function, arguments valid against its
    schema (no parser flag: the server writes the call around the arguments)."""
    named = {"type": "function", "function": {"name": "get_forecast"}}
    for seed in range(3):
        r = random_client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "Plan my trip."}],
            tools=RANDOM_TOOLS,  # type: ignore[arg-type]
            tool_choice=named,  # type: ignore[arg-type]
            temperature=0.8,
            seed=seed,
            max_tokens=600,
            stream=stream,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        (choice,) = collect_stream(r) if stream else [c.model_dump() for c in r.choices]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_forecast" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_cut_forced_call_is_not_complete(random_client: OpenAI, stream: bool, choice: Any) -> None:
    """max_tokens too small for the forced call: finish_reason "length", and no call that
    looks complete (none, or the arguments as far as they went: never a "{}" stand-in)."""
    max_tokens = 22 if choice == "required" else 6  # a call begun, not finished (see the LLM's)
    r = plan_trip(random_client, max_tokens=max_tokens, stream=stream, tool_choice=choice)
    choices = collect_stream(r) if stream else [c.model_dump() for c in r.choices]
    assert len(choices) == 3
    for c in choices:
        assert c["finish_reason"] == "length", c
        for call in c["message"]["tool_calls"] or []:
            with pytest.raises(ValueError):
                json.loads(call["function"]["arguments"])
