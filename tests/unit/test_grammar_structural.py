"""The structural-tag constraint kind (SamplingParams.structural_tag), compiled by the scheduler's
grammar state, and OutputParser.constrain, which makes one from a request's forced tool calls or
holds its output constraint off until the reasoning ends: free thinking, constrained answer;
with the reasoning closed by the prompt (thinking off) the constraint holds from the first
token; with it opened by the prompt (or DeepSeek-R1) the reasoning must be closed first."""

from __future__ import annotations

import json
from typing import Any

import pytest

from minisgl import SamplingParams
from minisgl.ext.structured.grammar import GrammarError, GrammarState, grammar_key
from minisgl.ext.structured.parsers import (
    OutputParser,
    ToolChoice,
    get_reasoning_parser,
    get_tool_parser,
    parse_tools,
)
from support.tokenizer import build_tiny_tokenizer

VOCAB = 512  # the tiny models' (support/models.py)
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
}
FUNCTIONS = parse_tools(
    [{"type": "function", "function": {"name": "get_weather", "parameters": ANSWER_SCHEMA}}]
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
THINKING = "<think>\nAnswer {in} JSON, not <tool_call>.\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer(tool_tokens=True)


def accepts(tokenizer: Any, params: SamplingParams, text: str) -> bool:
    """Whether the request's constraint takes `text` and then lets it end (EOS)."""
    state = GrammarState(VOCAB, 4, pin=False)
    constraint = state.constraint(params, tokenizer, {tokenizer.eos_token_id})
    assert constraint is not None
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not constraint.accept(token):
            return False
    return constraint.accept(tokenizer.eos_token_id) and constraint.terminated


def test_structural_tag_kind(tokenizer: Any) -> None:
    fmt = {"type": "structural_tag", "format": {"type": "const_string", "value": "yes"}}
    params = SamplingParams(structural_tag=fmt)  # a dict is kept as its JSON text
    assert grammar_key(params) == ("structural_tag", json.dumps(fmt))
    assert accepts(tokenizer, params, "yes") and not accepts(tokenizer, params, "no")
    with pytest.raises(ValueError, match="at most one of .*structural_tag"):
        SamplingParams(json_schema="{}", structural_tag=fmt)
    with pytest.raises(ValueError, match="structural_tag must be a string"):
        SamplingParams(structural_tag=3)  # type: ignore[arg-type]
    bad = SamplingParams(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}')
    state = GrammarState(VOCAB, 4, pin=False)
    constraint = state.constraint(bad, tokenizer, {tokenizer.eos_token_id})
    assert constraint is not None
    with pytest.raises(GrammarError, match="invalid structural_tag"):
        constraint.wait()


def test_answer_constraint_after_reasoning(tokenizer: Any) -> None:
    qwen3 = OutputParser(get_reasoning_parser("qwen3"))
    given = SamplingParams(json_schema=ANSWER_SCHEMA)
    answer = '{"city": "Paris"}'
    # the model may think first (the prompt left it open): the thinking is free text
    free = qwen3.constrain(given)
    assert free.get("json_schema") is None and free.get("structural_tag") is not None
    assert accepts(tokenizer, free, THINKING + answer)
    assert accepts(tokenizer, free, answer)
    assert not accepts(tokenizer, free, THINKING + '{"city": "Oslo"}')
    assert not accepts(tokenizer, free, "Sure! " + answer)
    # the prompt opened the thinking: it must be closed before the answer
    opened = qwen3.constrain(given, in_reasoning=True)
    assert accepts(tokenizer, opened, THINKING.removeprefix("<think>\n") + answer)
    assert not accepts(tokenizer, opened, answer)
    # thinking off (the prompt closed an empty block): the constraint as it was
    assert qwen3.constrain(given, in_reasoning=False) == given
    # DeepSeek-R1 starts inside the reasoning, whatever the prompt
    r1 = OutputParser(get_reasoning_parser("deepseek_r1")).constrain(given)
    assert accepts(tokenizer, r1, "Hmm.\n</think>\n\n" + answer)
    assert not accepts(tokenizer, r1, answer)
    # no reasoning parser: nothing moves
    assert OutputParser().constrain(given) == given


@pytest.mark.parametrize(
    "kind, value, good, bad",
    [
        ("regex", "[0-9]{2}", "42", "4a"),
        ("ebnf", 'root ::= "yes" | "no"', "no", "maybe"),
        ("json_schema", '{"type": "array"}', "[1, 2]", "{}"),
    ],
)
def test_every_kind_after_reasoning(
    tokenizer: Any, kind: str, value: str, good: str, bad: str
) -> None:
    params = OutputParser(get_reasoning_parser("qwen3")).constrain(SamplingParams(**{kind: value}))
    assert grammar_key(params) is not None and grammar_key(params)[0] == "structural_tag"  # type: ignore[index]
    assert accepts(tokenizer, params, THINKING + good)
    assert not accepts(tokenizer, params, THINKING + bad)


def test_json_whitespace_after_reasoning(tokenizer: Any) -> None:
    """One whitespace character at most between JSON elements (unless any_whitespace)."""
    parser = OutputParser(get_reasoning_parser("qwen3"))
    given = SamplingParams(json_schema='{"type": "object"}')
    padded = THINKING + '{"a":  1}'
    assert accepts(tokenizer, parser.constrain(given), THINKING + '{"a": 1}')
    assert not accepts(tokenizer, parser.constrain(given), padded)
    assert accepts(tokenizer, parser.constrain(given, any_whitespace=True), padded)


def test_forced_calls(tokenizer: Any) -> None:
    parser = OutputParser(get_reasoning_parser("qwen3"), get_tool_parser("hermes"))
    forced = (FUNCTIONS, ToolChoice("required"), True)
    params = parser.constrain(SamplingParams(temperature=0.8, seed=3), forced)
    assert params.temperature == 0.8 and params.seed == 3  # only the constraint is added
    assert accepts(tokenizer, params, THINKING + CALL)
    assert accepts(tokenizer, params, CALL + "\n" + CALL)
    assert not accepts(tokenizer, params, CALL.replace("Rome", "Oslo"))
    assert not accepts(tokenizer, params, THINKING + "It is sunny.")
    one = parser.constrain(SamplingParams(), (FUNCTIONS, ToolChoice("required"), False))
    assert accepts(tokenizer, one, CALL) and not accepts(tokenizer, one, CALL + "\n" + CALL)
    off = parser.constrain(SamplingParams(), forced, in_reasoning=False)
    assert not accepts(tokenizer, off, THINKING + CALL) and accepts(tokenizer, off, CALL)
    # auto forces nothing: an output constraint still moves after the reasoning
    auto = parser.constrain(SamplingParams(regex="x"), (FUNCTIONS, ToolChoice("auto"), True))
    assert accepts(tokenizer, auto, THINKING + "x")
    with pytest.raises(ValueError, match="tool_choice: 'required' forces tool calls"):
        parser.constrain(SamplingParams(json_schema="{}"), forced)
    with pytest.raises(ValueError, match="tool_choice: required calls cannot be enforced"):
        OutputParser().constrain(SamplingParams(), forced)
