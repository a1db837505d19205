"""Anthropic's Messages API (/v1/messages, ext/agent/messages.py) through the official
`anthropic` SDK, unmodified: on the scripted tiny model behind `--tool-call-parser hermes
--reasoning-parser qwen3 --api-key` (a thinking block and a tool_use block, the tool_result round
trip, stop sequences, max_tokens, streamed with the SDK's helper and equal to the plain answer),
on a plain random tiny model (text), and the refusals in Anthropic's error shape."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest

from support.scripted import build_scripted_model
from support.server import TINY_SERVER, Server, run_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")

KEY = "sk-messages-test"
# this SDK's create() no longer takes temperature; the API (and this server) still does
GREEDY = {"temperature": 0}
AUTH = {"x-api-key": KEY}
THINKING = "The user wants the weather in Paris. I will call get_weather."
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
SCRIPT = (
    f"<think>\n{THINKING}\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
ANSWER = "<think>\nThe tool said 21 degrees.\n</think>\n\nIt is 21 degrees in Paris."
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build_scripted_model(str(tmp_path_factory.mktemp("scripted")), SCRIPT, ANSWER)
    log = str(tmp_path_factory.mktemp("logs") / "s.log")
    parsers = ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    with run_server(
        model, *parsers, "--served-model-name", "x", "--api-key", KEY, log_path=log
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, **body: Any) -> Any:
    """A greedy message (typed loosely: the SDK's params are TypedDicts)."""
    body = {"model": "x", "max_tokens": 200, "messages": ASK, "extra_body": GREEDY} | body
    return client.messages.create(**body)


def streamed(client: anthropic.Anthropic, **body: Any) -> tuple[str, Any]:
    """The text of the SDK's text_stream and its final message, for the same greedy request."""
    body = {"model": "x", "max_tokens": 200, "messages": ASK, "extra_body": GREEDY} | body
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def without_ids(message: Any) -> dict[str, Any]:
    """A message's dump without the ids that differ between two answers, its usage's input
    counted whole (a repeated prompt reads more of it from the prefix cache)."""
    dump = message.model_dump(exclude_none=True)
    dump.pop("id")
    for block in dump["content"]:
        block.pop("id", None)
    usage = dump["usage"]
    usage["input_tokens"] += usage.pop("cache_read_input_tokens", 0)
    return dump


def check_call(message: Any) -> Any:
    """The scripted answer: thinking, then the get_weather call."""
    thinking, call = message.content
    assert thinking.type == "thinking" and thinking.thinking == THINKING
    assert isinstance(thinking.signature, str) and thinking.signature
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "get_weather" and call.input == ARGUMENTS
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    return call


def test_tool_use_with_thinking(client: anthropic.Anthropic) -> None:
    message = create(client, tools=[WEATHER])
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "x"
    check_call(message)
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_stream_equals_create(client: anthropic.Anthropic) -> None:
    """The SDK's stream helper builds the same message from the events (ids aside)."""
    plain = create(client, tools=[WEATHER])
    text, final = streamed(client, tools=[WEATHER])
    check_call(final)
    assert text == "" and without_ids(final) == without_ids(plain)


def test_event_sequence(server: Server) -> None:
    """The raw events: each `event:` line names its data's type, in Anthropic's order."""
    body = {"model": "x", "max_tokens": 200, "messages": ASK, "tools": [WEATHER], "stream": True}
    headers = {"x-api-key": KEY}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = []
    for chunk in r.text.strip().split("\n\n"):
        event, data = chunk.split("\n")
        name = event.removeprefix("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks = [n for n in names if n in ("content_block_start", "content_block_stop")]
    assert blocks == ["content_block_start", "content_block_stop"] * 2  # thinking, tool_use


def test_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    first = create(client, tools=[WEATHER])
    call = check_call(first)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}
    turns = [*ASK, first.to_param(), {"role": "user", "content": [result]}]
    final = create(client, tools=[WEATHER], messages=turns)
    thinking, text = final.content
    assert thinking.thinking == "The tool said 21 degrees."
    assert text.type == "text" and text.text == "It is 21 degrees in Paris."
    assert final.stop_reason == "end_turn" and final.stop_sequence is None
    streamed_text, streamed_final = streamed(client, tools=[WEATHER], messages=turns)
    assert streamed_text == text.text and without_ids(streamed_final) == without_ids(final)


def after_tool() -> list[Any]:
    """A history ending with the tool's result (the script's second turn comes next)."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGUMENTS}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "21 C"}],
    }
    return [*ASK, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    turns = after_tool()
    message = create(client, tools=[WEATHER], messages=turns, stop_sequences=["in Paris"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "in Paris"
    assert message.content[-1].text == "It is 21 degrees "
    text, final = streamed(client, tools=[WEATHER], messages=turns, stop_sequences=["in Paris"])
    assert text == "It is 21 degrees " and without_ids(final) == without_ids(message)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_reason(server: Server, stream: bool) -> None:
    """What the conversion reads: the chat choice's stop_reason (vLLM's), the stop string that
    ended it; absent when none did."""
    chat = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "21 C"}]
    for stop, expected in ((["in Paris"], "in Paris"), (None, None)):
        body = {"model": "x", "messages": chat, "stop": stop, "stream": stream, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            choices = [r.json()["choices"][0]]
        else:
            events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
            choices = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
        assert [c.get("stop_reason") for c in choices if c["finish_reason"]] == [expected]
        assert all("stop_reason" not in c for c in choices if not c["finish_reason"])


def test_max_tokens(client: anthropic.Anthropic) -> None:
    message = create(client, tools=[WEATHER], max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert len(message.content) == 1  # cut inside the thinking (unclosed: qwen3's text)
    _, final = streamed(client, tools=[WEATHER], max_tokens=3)
    assert without_ids(final) == without_ids(message)


def test_named_tool_choice(client: anthropic.Anthropic) -> None:
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    check_call(create(client, tools=[WEATHER], tool_choice=choice))


def test_count_tokens(client: anthropic.Anthropic) -> None:
    message = create(client, tools=[WEATHER])
    counted = client.messages.count_tokens(model="x", messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
    cached = message.usage.cache_read_input_tokens or 0  # the prompt's part the cache supplied
    assert counted.input_tokens == message.usage.input_tokens + cached
    without_tools = client.messages.count_tokens(model="x", messages=ASK)
    assert without_tools.input_tokens < counted.input_tokens


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}


@pytest.mark.parametrize(
    "change, named",
    [
        ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [DOCUMENT]}]}, "'document'"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"container": "c"}, "container"),
        ({"unknown_thing": 1}, "unknown_thing"),
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "system", "content": "s"}]}, "messages[0].role"),
        ({"messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "prefill"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"stop_sequences": "x"}, "stop_sequences"),
    ],
)
def test_refused(server: Server, change: dict[str, Any], named: str) -> None:
    body = {"model": "x", "max_tokens": 2000, "messages": ASK} | change
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert named in anthropic_error(r, 400, "invalid_request_error")


def test_thinking_switches(client: anthropic.Anthropic) -> None:
    """adaptive (the model decides) and a budget that cannot bind are taken; disabled too."""
    for thinking in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}):
        check_call(create(client, tools=[WEATHER], thinking=thinking))
    create(client, tools=[WEATHER], thinking={"type": "disabled"})  # the template's switch


def test_unknown_model(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        create(client, model="claude-nope")
    assert isinstance(e.value.body, dict)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"


def test_api_key(server: Server) -> None:
    """A wrong x-api-key: Anthropic's 401 (count_tokens too); the Bearer header still works."""
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        create(wrong)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": "x", "messages": ASK})
    anthropic_error(r, 401, "authentication_error")
    bearer = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        json={"model": "x", "messages": ASK},
        headers=bearer,
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    r = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY})  # any route
    assert r.status_code == 200


@pytest.fixture(scope="module")
def tiny(shared_server: Callable[..., Server]) -> Server:
    return shared_server(*TINY_SERVER)


def test_text_on_plain_model(tiny: Server) -> None:
    """A plain model: one text block; the stream's text and final message equal the plain one;
    thinking needs the reasoning parser."""
    client = anthropic.Anthropic(base_url=tiny.url, api_key="none", max_retries=0, timeout=120)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "messages": ASK}
    body["extra_body"] = GREEDY
    body["system"] = [{"type": "text", "text": "Be brief."}]
    message = client.messages.create(**body)
    (text,) = message.content
    assert text.type == "text" and text.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    streamed_text, final = streamed(client, **body)
    assert streamed_text == text.text and without_ids(final) == without_ids(message)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**body, thinking={"type": "adaptive"})
    assert "--reasoning-parser" in str(e.value)


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_events_split_into_lines_only_at_their_own_line_ends(kind: str) -> None:
    """Text with characters JSON keeps raw but str.splitlines takes for line ends, in each
    API's event: httpx's iter_lines (which splits there) reads the event whole (a test client
    once read half an event, crashed, and its stream's abort left the watchdog nothing to do)."""
    from httpx._decoders import LineDecoder

    from minisgl.ext.agent.messages_reply import event
    from minisgl.ext.agent.responses_output import sse_event
    from minisgl.server.api_server import sse

    text = "a\u2028b\x85c\u2029d"
    make = {"chat": sse, "responses": sse_event, "messages": lambda body: event("x", body)}
    lines = LineDecoder().decode(make[kind]({"type": "x", "text": text}))
    assert lines[-1] == "" and json.loads(lines[-2].removeprefix("data: "))["text"] == text
