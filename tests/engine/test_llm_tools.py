"""Offline `LLM.chat` with forced tool calls and reasoning: on a random tiny model, sampled at
temperature 0.8, `tool_choice` required / named always gives calls whose arguments validate
against the function's schema (one call without parallel_tool_calls); on the scripted model,
a JSON-schema constraint applies to the answer after the reasoning, not to the thinking."""

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
    (result,) = llm.chat(
        [CHAT],
        SAMPLED,
        use_tqdm=False,
        tools=TOOLS,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        chat_template_kwargs=THINKING_OFF,
        **kwargs,
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


def test_free_output_is_not_a_call(llm: LLM) -> None:
    """Without the grammar the same sampling gives no parsable call: the test can fail."""
    (result,) = llm.chat([CHAT], SAMPLED, use_tqdm=False, tools=TOOLS, tool_call_parser="hermes")
    assert all(not sample["tool_calls"] for sample in result["outputs"])


def test_refusals(llm: LLM) -> None:
    with pytest.raises(ValueError, match="tool_choice: is only allowed when tools are given"):
        llm.chat([CHAT], tool_choice="required", tool_call_parser="hermes")
    with pytest.raises(ValueError, match="'nope' is not among the given tools"):
        named = {"type": "function", "function": {"name": "nope"}}
        llm.chat([CHAT], tools=TOOLS, tool_choice=named, tool_call_parser="hermes")
    with pytest.raises(ValueError, match="cannot be enforced without a tool call parser"):
        llm.chat([CHAT], tools=TOOLS, tool_choice="required")
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
