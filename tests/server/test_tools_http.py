"""Tool calling and reasoning end to end: a server with `--tool-call-parser hermes
--reasoning-parser qwen3` on the scripted tiny model (support/scripted.py), whose greedy answer
thinks and then calls get_weather, and answers after the tool's result; through the official
openai client, streamed and not; and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from support.scripted import build_scripted_model
from support.server import REPO, Server, run_server

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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build_scripted_model(str(tmp_path_factory.mktemp("scripted")), SCRIPT, ANSWER)
    log = str(tmp_path_factory.mktemp("logs") / "s.log")
    parsers = ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    with run_server(model, *parsers, "--served-model-name", "x", log_path=log) as s:
        yield s


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


def test_agent_loop(client: OpenAI) -> None:
    """call -> the tool's result -> the final answer, with the call sent back in the history."""
    messages: list[Any] = list(CHAT)
    first = create(client, messages=messages, tools=TOOLS)
    call = (first.choices[0].message.tool_calls or [])[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "21 C"})
    final = create(client, messages=messages, tools=TOOLS)
    choice = final.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "It is 21 degrees in Paris."
    assert choice.message.reasoning_content == "The tool said 21 degrees."


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "not supported yet"),
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "tool_choice",
            "not supported yet",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among the given tools",
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
    if "not supported yet" in words:
        assert error["code"] == "unsupported_parameter"


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
