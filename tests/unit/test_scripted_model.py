"""The scripted tiny model (support/scripted.py): its greedy answer is its script, token for
token, in transformers and in minisgl's offline LLM, after a plain chat turn and after a tool
result; scripts that a last-token chain cannot follow are refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from support.invariants import check_no_leak
from support.scripted import START, START_AFTER_TOOL, build_scripted_model, split_unique

SCRIPT = (
    "<think>\nThe user wants the weather in Paris. I will call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
ANSWER = "<think>\nThe tool said 21 degrees.\n</think>\n\nIt is 21 degrees in Paris."
CHAT: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
FUNCTION = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
CALL = {"id": "call_0", "type": "function", "function": FUNCTION}
AFTER_TOOL: list[dict[str, Any]] = [
    *CHAT,
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": "21 C"},
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_scripted_model(str(tmp_path_factory.mktemp("scripted")), SCRIPT, ANSWER)


def test_split_unique() -> None:
    taken: set[str] = set()
    pieces = split_unique('{"a": "b"}', taken)
    assert "".join(pieces) == '{"a": "b"}' and len(set(pieces)) == len(pieces)
    assert split_unique("aab", set()) == ["a", "ab"]
    assert split_unique("aa", set()) == ["aa"]  # a taken tail is glued to the piece before
    with pytest.raises(ValueError):
        split_unique("a", {"a"})


def test_transformers_follows_the_script(scripted: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(scripted)
    model = AutoModelForCausalLM.from_pretrained(scripted).eval()
    for chat, start, text in ((CHAT, START, SCRIPT), (AFTER_TOOL, START_AFTER_TOOL, ANSWER)):
        prompt = tokenizer.apply_chat_template(  # type: ignore[arg-type]
            chat,
            tools=[{"type": "function", "function": {"name": "get_weather"}}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert ids[-1] == tokenizer.convert_tokens_to_ids(start)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=200,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert out[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(out[:-1]) == text


def test_offline_llm_follows_the_script(scripted: str) -> None:
    llm = LLM(scripted, page_size=4, num_pages=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200)
        first, second = llm.chat([CHAT, AFTER_TOOL], params, use_tqdm=False)
        assert first["text"] == SCRIPT and first["finish_reason"] == "stop"
        assert second["text"] == ANSWER
    finally:
        llm.shutdown()


def test_ambiguous_token_scripts_are_refused(tmp_path) -> None:
    from support.tokenizer import build_tiny_tokenizer

    ids = build_tiny_tokenizer().encode(" the cat the dog")  # " the" is followed twice
    with pytest.raises(ValueError, match="two successors"):
        build_scripted_model(str(tmp_path), ids)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_offline_chat_parses_reasoning_and_tool_calls(scripted: str) -> None:
    """LLM.chat with tools and vLLM's parser names: the reasoning, the call and, after the
    tool's result, the answer, parsed as the server returns them."""
    llm = LLM(scripted, page_size=4, num_pages=256)
    params = SamplingParams(max_tokens=128)
    parsers = dict(tools=TOOLS, tool_call_parser="hermes", reasoning_parser="qwen3")
    (first,) = llm.chat([CHAT], params, use_tqdm=False, **parsers)
    assert first["reasoning_content"].startswith("The user wants the weather in Paris.")
    assert first["content"] is None and first["finish_reason"] == "stop"
    (call,) = first["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    (second,) = llm.chat([AFTER_TOOL], params, use_tqdm=False, **parsers)
    assert second["content"] == "It is 21 degrees in Paris." and second["tool_calls"] == []
    assert second["reasoning_content"] == "The tool said 21 degrees."
    # no parser given: auto, hermes from the template's <tool_call> (it has no <think>)
    (auto,) = llm.chat([CHAT], params, use_tqdm=False, tools=TOOLS)
    assert [c["function"] for c in auto["tool_calls"]] == [call["function"]]
    assert auto["content"] == SCRIPT[: SCRIPT.index("\n\n<tool_call>")]
    off = dict(tool_call_parser="none", reasoning_parser="none")
    (raw,) = llm.chat([CHAT], params, use_tqdm=False, tools=TOOLS, **off)  # the raw text
    assert raw["text"] == SCRIPT and "tool_calls" not in raw
    with pytest.raises(ValueError, match="valid names: hermes"):
        llm.chat([CHAT], params, use_tqdm=False, tool_call_parser="nope")
    bad = [{"type": "function", "function": {"parameters": {}}}]
    with pytest.raises(ValueError, match="tools"):
        llm.chat([CHAT], params, use_tqdm=False, tools=bad)
    check_no_leak(llm.scheduler)
