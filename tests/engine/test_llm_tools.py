"""Offline `LLM.chat` with forced tool calls and reasoning: on a random tiny model, sampled at
temperature 0.8, `tool_choice` required / named always gives calls whose arguments validate
against the function's schema (one call without parallel_tool_calls), a named one with no tool
call parser at all (the answer is the arguments); a call cut by max_tokens stays incomplete; on
the scripted model, a JSON-schema constraint applies to the answer after the reasoning, not to
the thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from minisgl import LLM, SamplingParams
from support.scripted import build_scripted_model
from support.tool_model import SCHEMAS, TOOLS, make_random_tool_model

CHAT = [{"role": "user", "content": "Plan my trip."}]
THINKING_OFF = {"enable_thinking": False}
SAMPLED = SamplingParams(temperature=0.8, seed=0, n=3, max_tokens=600)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    model = make_random_tool_model(str(tmp_path_factory.mktemp("tool_model")))
    engine = LLM(model, page_size=4)
    yield engine
    engine.shutdown()


def calls_of(llm: LLM, **kwargs: Any) -> list[list[dict[str, Any]]]:
    """The tool calls of each sample; every one's arguments valid against its schema."""
    parsers = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"} | kwargs
    (result,) = llm.chat(
        [CHAT], SAMPLED, use_tqdm=False, tools=TOOLS, chat_template_kwargs=THINKING_OFF, **parsers
    )
    samples = []
    for sample in result["outputs"]:
        assert sample["finish_reason"] == "stop", sample["text"]
        assert sample["content"] is None and sample["reasoning_content"] is None
        for call in sample["tool_calls"]:
            function = call["function"]
            jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])
        samples.append(sample["tool_calls"])
    return samples


def test_required_and_named(llm: LLM) -> None:
    required = calls_of(llm, tool_choice="required")
    assert all(len(calls) >= 1 for calls in required)
    named = calls_of(llm, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert {c["function"]["name"] for calls in named for c in calls} == {"get_time"}
    single = calls_of(llm, tool_choice="required", parallel_tool_calls=False)
    assert all(len(calls) == 1 for calls in single)
    # the samples differ: the grammar constrains sampling, it does not make it greedy
    assert len({json.dumps(calls) for calls in single}) > 1


@pytest.mark.parametrize("parsers", [{}, {"tool_call_parser": "none"}])
def test_named_needs_no_parser(llm: LLM, parsers: dict[str, str]) -> None:
    """Named: exactly one call of that function, its arguments the whole (schema-valid) answer,
    with the parsers left to auto (hermes, qwen3 from this template) or with none at all."""
    named = {"type": "function", "function": {"name": "get_forecast"}}
    for seed in range(3):
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=600)
        (sample,) = llm.chat(
            [CHAT],
            params,
            use_tqdm=False,
            tools=TOOLS,
            tool_choice=named,
            chat_template_kwargs=THINKING_OFF,
            **parsers,
        )
        assert sample["finish_reason"] == "stop" and sample["content"] is None
        (call,) = sample["tool_calls"]
        assert call["function"]["name"] == "get_forecast"
        assert call["function"]["arguments"] == sample["text"]  # no wrapper was written
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_forecast"])


@pytest.mark.parametrize(
    ("choice", "max_tokens"),
    [("required", 22), ({"type": "function", "function": {"name": "get_time"}}, 6)],
)
def test_cut_call_is_not_complete(llm: LLM, choice: Any, max_tokens: int) -> None:
    """max_tokens too small for a forced call: finish_reason "length", and no call that looks
    complete: none, or its arguments as far as they went, never a "{}" stand-in (at 22 tokens
    one of these samples has written `"arguments": ` and nothing more)."""
    params = SamplingParams(temperature=0.8, seed=0, n=3, max_tokens=max_tokens)
    (result,) = llm.chat(
        [CHAT],
        params,
        use_tqdm=False,
        tools=TOOLS,
        tool_choice=choice,
        chat_template_kwargs=THINKING_OFF,
    )
    calls = [call for sample in result["outputs"] for call in sample["tool_calls"]]
    assert calls  # some call was begun: its arguments are what the test is about
    for sample in result["outputs"]:
        assert sample["finish_reason"] == "length"
    for call in calls:
        with pytest.raises(ValueError):
            json.loads(call["function"]["arguments"])


def test_refusals(llm: LLM) -> None:
    with pytest.raises(ValueError, match="tool_choice: is only allowed when tools are given"):
        llm.chat([CHAT], tool_choice="required", tool_call_parser="hermes")
    with pytest.raises(ValueError, match="'nope' is not among the given tools"):
        named = {"type": "function", "function": {"name": "nope"}}
        llm.chat([CHAT], tools=TOOLS, tool_choice=named, tool_call_parser="hermes")
    with pytest.raises(ValueError, match="cannot be enforced without a tool call parser"):
        llm.chat([CHAT], tools=TOOLS, tool_choice="required", tool_call_parser="none")
    with pytest.raises(ValueError, match="cannot be combined with another output constraint"):
        constrained = SamplingParams(json_schema={"type": "object"})
        llm.chat(
            [CHAT], constrained, tools=TOOLS, tool_choice="required", tool_call_parser="hermes"
        )


THOUGHT = "I will answer in JSON, not in prose."
ANSWER = {"city": "Paris", "days": 3}


def test_json_answer_after_reasoning(tmp_path: Any) -> None:
    script = f"<think>\n{THOUGHT}\n</think>\n\n{json.dumps(ANSWER)}"
    model = LLM(build_scripted_model(str(tmp_path), script), page_size=4)
    try:
        schema = {**SCHEMAS["get_forecast"], "required": ["city", "days"]}
        params = SamplingParams(json_schema=schema, max_tokens=80)
        (thought,) = model.chat([CHAT], params, use_tqdm=False, reasoning_parser="qwen3")
        assert thought["reasoning_content"] == THOUGHT  # the thinking was free
        assert json.loads(thought["content"]) == ANSWER
        # without a reasoning parser the constraint holds from the first token: no thinking
        (plain,) = model.chat([CHAT], params, use_tqdm=False)
        assert not plain["text"].startswith("<think>")
    finally:
        model.shutdown()
