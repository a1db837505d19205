"""Tool-call and reasoning parsers (minisgl.ext.structured.parsers) on responses written as
Qwen3, Qwen2.5, Llama 3.1, Mistral and DeepSeek-R1 emit them (from their chat templates and
documentation): each parsed whole, then streamed by every cut into two pieces and by seeded
random splits into 1-4 character pieces; the stream must reassemble exactly to the whole parse
(so no piece of a tag ever reaches the content), with each call's id and name first and alone.
Then the request side (tools, tool_choice) and the grammars that enforce tool_choice."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from minisgl.ext.structured.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    OutputParser,
    ParsedOutput,
    ToolCall,
    ToolChoice,
    ToolSpecError,
    counter_ids,
    get_reasoning_parser,
    get_tool_parser,
    parse_tools,
    resolve_tool_choice,
)

AUTO = ToolChoice("auto")
WEATHER = '{"city": "Paris", "unit": "celsius"}'


@dataclass
class Case:
    name: str
    reasoning: str | None  # parser names
    tools: str | None
    text: str
    content: str | None
    reasoning_text: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    in_reasoning: bool = False


CASES = [
    Case(
        "qwen3_thinking_tool_call",
        "qwen3",
        "hermes",
        "<think>\nThe user asks for the weather in Paris. I should call get_weather.\n</think>\n\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        "The user asks for the weather in Paris. I should call get_weather.",
        [("get_weather", WEATHER)],
    ),
    Case(
        "qwen3_thinking_answer",
        "qwen3",
        "hermes",
        "<think>\nSimple arithmetic: 2 + 2 = 4.\n</think>\n\n2 + 2 = **4**.",
        "2 + 2 = **4**.",
        "Simple arithmetic: 2 + 2 = 4.",
    ),
    Case(
        "qwen3_thinking_off",  # enable_thinking=False: no tag in the response
        "qwen3",
        "hermes",
        "The capital of France is Paris. A </think> here is just text.",
        "The capital of France is Paris. A </think> here is just text.",
    ),
    Case(
        "qwen3_prompt_opened_thinking",  # the template ended the prompt with "<think>\n"
        "qwen3",
        None,
        "Let me think.\n</think>\n\nParis.",
        "Paris.",
        "Let me think.",
        in_reasoning=True,
    ),
    Case(
        "qwen25_parallel_calls",
        None,
        "hermes",
        "I'll look up both cities.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>',
        "I'll look up both cities.",
        None,
        [("get_weather", WEATHER), ("get_weather", '{"city": "Tokyo"}')],
    ),
    Case(
        "qwen25_nested_arguments",
        None,
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\" }{ <tool_call>", '
        '"filters": [{"k": -1.5e3, "ok": true, "none": null}], "u": "\\u00e9"}}\n</tool_call>',
        None,
        None,
        [
            (
                "search",
                '{"q": "a \\"quoted\\" }{ <tool_call>", "filters": '
                '[{"k": -1.5e3, "ok": true, "none": null}], "u": "\\u00e9"}',
            )
        ],
    ),
    Case(
        "hermes_no_arguments_and_text_after",
        None,
        "hermes",
        '<tool_call>{"name": "now"}</tool_call>\n\nDone.',
        "Done.",
        None,
        [("now", "{}")],
    ),
    Case(
        "hermes_malformed_is_content",
        None,
        "hermes",
        "<tool_call>\n{name: get_weather}\n</tool_call>",
        "<tool_call>\n{name: get_weather}\n</tool_call>",
    ),
    Case(
        "hermes_near_tags_are_content",
        None,
        "hermes",
        "Use a <tool> or <tool_c; tags like <tool_call",
        "Use a <tool> or <tool_c; tags like <tool_call",
    ),
    Case(
        "hermes_truncated_call",  # max_tokens inside the arguments: as OpenAI, partial JSON
        None,
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        None,
        None,
        [("get_weather", '{"city": "Par')],
    ),
    Case(
        "hermes_arguments_before_name",
        None,
        "hermes",
        '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',
        None,
        None,
        [("f", '{"x": 1}')],
    ),
    Case(
        "llama31_python_tag",
        None,
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    Case(
        "llama31_bare_json_two_calls",
        None,
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        None,
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')],
    ),
    Case(
        "llama31_answer_with_json_inside",
        None,
        "llama3_json",
        'Here is JSON: {"name": "x", "parameters": {}}',
        'Here is JSON: {"name": "x", "parameters": {}}',
    ),
    Case(
        "llama31_json_that_is_not_a_call",
        None,
        "llama3_json",
        '{"answer": 42}',
        '{"answer": 42}',
    ),
    Case(
        "mistral_list",
        None,
        "mistral",
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
        '{"name": "get_current_weather", "arguments": {"city": "San Francisco"}}]',
        None,
        None,
        [("add", '{"a": 3.5, "b": 4}'), ("get_current_weather", '{"city": "San Francisco"}')],
    ),
    Case(
        "mistral_list_content_before",
        None,
        "mistral",
        'Hello[TOOL_CALLS] [{"arguments": {"a": 1, "b": 2}, "name": "add"}]',
        "Hello",
        None,
        [("add", '{"a": 1, "b": 2}')],
    ),
    Case(
        "mistral_v11",
        None,
        "mistral",
        '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}',
        None,
        None,
        [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')],
    ),
    Case(
        "mistral_v11_no_arguments",
        None,
        "mistral",
        "hi[TOOL_CALLS]toolname_no_args",
        "hi",
        None,
        [("toolname_no_args", "{}")],
    ),
    Case(
        "mistral_not_json",
        None,
        "mistral",
        "[TOOL_CALLS] not json at all",
        "[TOOL_CALLS] not json at all",
    ),
    Case(
        "qwen3_coder_call",  # Qwen3-Coder's XML; values by type (no schema here: JSON if it parses)
        None,
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
        "\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "I'll check.",
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    Case(
        "qwen3_coder_two_calls_multiline",
        None,
        "qwen3_coder",
        "<tool_call>\n<function=write>\n<parameter=text>\nline 1\n<b>line 2</b>\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
        None,
        None,
        [("write", '{"text": "line 1\\n<b>line 2</b>"}'), ("now", "{}")],
    ),
    Case(
        "qwen3_coder_bare_function_and_text_after",
        "qwen3",
        "qwen3_coder",
        "<think>\nx\n</think>\n\n<function=f>\n<parameter=o>\n"
        '{"k": [1, true]}\n</parameter>\n</function>\nDone.',
        "Done.",
        "x",
        [("f", '{"o": {"k": [1, true]}}')],
    ),
    Case(
        "qwen3_coder_malformed_is_content",
        None,
        "qwen3_coder",
        "<tool_call>\n<func=f>\n</tool_call>.<function=bad name>",
        "<tool_call>\n<func=f>\n</tool_call>.<function=bad name>",
    ),
    Case(
        "deepseek_r1_no_opening_tag",
        "deepseek_r1",
        None,
        "Okay, the user wants 17 * 3. That is 51.\n</think>\n\n17 × 3 = 51.",
        "17 × 3 = 51.",
        "Okay, the user wants 17 * 3. That is 51.",
    ),
    Case(
        "deepseek_r1_with_opening_tag",
        "deepseek_r1",
        None,
        "<think>\nHmm.\n\nYes.\n</think>\n\nYes.",
        "Yes.",
        "Hmm.\n\nYes.",
    ),
    Case(
        "deepseek_r1_truncated_thinking",
        "deepseek_r1",
        None,
        "Still thinking about </th",
        None,
        "Still thinking about </th",
    ),
    Case(
        "deepseek_r1_then_hermes_call",
        "deepseek_r1",
        "hermes",
        'Call it.</think><tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call>',
        None,
        "Call it.",
        [("f", '{"x": [1, 2]}')],
    ),
]


def parser_of(case: Case) -> OutputParser:
    reasoning = get_reasoning_parser(case.reasoning) if case.reasoning else None
    tools = get_tool_parser(case.tools) if case.tools else None
    return OutputParser(reasoning, tools)


def streamed(case: Case, pieces: list[str]) -> ParsedOutput:
    """Feed `pieces`, check the shape of every chunk, and reassemble the response."""
    stream = parser_of(case).stream(AUTO, case.in_reasoning, new_id=counter_ids())
    content, reasoning = "", ""
    calls: list[dict[str, str]] = []
    for delta in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
        content += delta.content
        reasoning += delta.reasoning
        for call in delta.tool_calls:
            if call.index == len(calls):  # a new call: id and name come first, once
                assert call.id is not None and call.name is not None
                calls.append({"id": call.id, "name": call.name, "arguments": ""})
            else:
                assert call.index == len(calls) - 1 and call.id is None and call.name is None
            calls[call.index]["arguments"] += call.arguments
    assert stream.has_tool_calls == bool(calls)
    tool_calls = [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls]
    return ParsedOutput(content or None, reasoning or None, tool_calls)


def random_pieces(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i : i + n])
        i += n
    return pieces


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_whole_and_streamed(case: Case) -> None:
    whole = parser_of(case).parse(case.text, AUTO, case.in_reasoning, new_id=counter_ids())
    assert whole.content == case.content
    assert whole.reasoning == case.reasoning_text
    assert [(c.name, c.arguments) for c in whole.tool_calls] == case.calls
    assert [c.id for c in whole.tool_calls] == [f"call_{i}" for i in range(len(case.calls))]
    for c in whole.tool_calls:
        if not c.arguments.endswith("Par"):  # the truncated case
            json.loads(c.arguments)
    text = case.text
    for cut in range(len(text) + 1):
        assert streamed(case, [text[:cut], text[cut:]]) == whole, f"cut at {cut}"
    rng = random.Random(0)
    for _ in range(20):
        assert streamed(case, random_pieces(text, rng)) == whole
    assert streamed(case, list(text)) == whole


def test_tool_choice_none_returns_raw_text() -> None:
    case = CASES[0]
    out = parser_of(case).parse(case.text, ToolChoice("none"))
    assert out.tool_calls == [] and out.reasoning == case.reasoning_text
    assert out.content is not None and out.content.startswith("<tool_call>\n{")


def test_ids() -> None:
    calls = get_tool_parser("hermes").parse(CASES[4].text).tool_calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].id != calls[1].id
    (call,) = get_tool_parser("mistral").parse(CASES[18].text).tool_calls
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates demand it
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "toolname_no_args", "arguments": "{}"},
    }


def test_qwen3_coder_values_follow_the_schema() -> None:
    """A string property stays a string even when it reads as JSON; others are JSON."""
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "number"}}}
    tools = [tool("f", parameters=schema)]
    text = (
        "<tool_call>\n<function=f>\n<parameter=s>\n42\n</parameter>\n<parameter=n>\n4.5\n"
        "</parameter>\n<parameter=x>\nnot json\n</parameter>\n</function>\n</tool_call>"
    )
    parser = OutputParser(tools=get_tool_parser("qwen3_coder"))
    (call,) = parser.parse(text, AUTO, functions=parse_tools(tools)).tool_calls
    assert json.loads(call.arguments) == {"s": "42", "n": 4.5, "x": "not json"}
    (untyped,) = parser.parse(text, AUTO).tool_calls
    assert json.loads(untyped.arguments)["s"] == 42


def test_registry() -> None:
    assert {"hermes", "llama3_json", "mistral", "qwen3_coder"} <= set(TOOL_PARSERS)
    assert {"qwen3", "deepseek_r1"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="valid names: .*hermes.*llama3_json.*mistral"):
        get_tool_parser("hermez")
    with pytest.raises(ValueError, match="valid names: deepseek_r1, qwen3"):
        get_reasoning_parser("qwen")
    assert get_tool_parser("mistral").special_tokens == ("[TOOL_CALLS]", "[ARGS]")
    assert get_tool_parser("hermes").special_tokens == ()
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.prompt_opens_reasoning("assistant\n<think>\n\n</think>\n\n")


# ---- the request side ------------------------------------------------------------------
def tool(name: str = "get_weather", **function: Any) -> dict[str, Any]:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": {"name": name, "parameters": params, **function}}


def test_parse_tools() -> None:
    (f,) = parse_tools([tool(description="Weather of a city")])
    assert f.name == "get_weather" and f.description == "Weather of a city"
    assert f.to_openai_tool()["function"]["parameters"]["required"] == ["city"]
    legacy = parse_tools(functions=[{"name": "now"}])
    assert legacy[0].parameters == {"type": "object", "properties": {}}
    assert parse_tools() == []


@pytest.mark.parametrize(
    "tools, param",
    [
        ("x", "tools"),
        (["x"], "tools[0]"),
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"parameters": {}}}], "tools[0].function.name"),
        ([tool(parameters="{}")], "tools[0].function.parameters"),
        ([tool(parameters={"type": "array"})], "tools[0].function.parameters"),
        ([tool(parameters={"properties": []})], "tools[0].function.parameters.properties"),
        ([tool(parameters={"required": "city"})], "tools[0].function.parameters.required"),
        ([tool(description=3)], "tools[0].function.description"),
        ([tool(), tool()], "tools[1].function.name"),
    ],
)
def test_bad_tools(tools: Any, param: str) -> None:
    with pytest.raises(ToolSpecError) as error:
        parse_tools(tools)
    assert error.value.param == param and str(error.value).startswith(param + ": ")


def test_tool_choice() -> None:
    functions = parse_tools([tool(), tool("now")])
    assert resolve_tool_choice(None, functions) == ToolChoice("auto")
    assert resolve_tool_choice(None, []) == ToolChoice("none")
    assert resolve_tool_choice("required", functions) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "now"}}
    assert resolve_tool_choice(named, functions) == ToolChoice("named", "now")
    assert resolve_tool_choice({"name": "now"}, functions, "function_call").name == "now"
    bad = [
        ("auto", [], "tool_choice", "only allowed when tools"),
        ("always", functions, "tool_choice", "must be one of"),
        (
            {"type": "function", "function": {"name": "x"}},
            functions,
            "tool_choice.function.name",
            "'x' is not among",
        ),
        ({"type": "tool"}, functions, "tool_choice.type", "must be 'function'"),
        (3, functions, "tool_choice", "string or an object"),
    ]
    for choice, given, param, message in bad:
        with pytest.raises(ToolSpecError, match=message) as error:
            resolve_tool_choice(choice, given)
        assert error.value.param == param
    with pytest.raises(ToolSpecError, match="not both"):
        parse_tools([tool()], [{"name": "f"}])


# ---- grammars for tool_choice required / named ------------------------------------------
@pytest.fixture(scope="module")
def compiler() -> Any:
    import xgrammar as xgr

    from support.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tool_tokens=True)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=512, stop_token_ids=[tokenizer.eos_token_id]
    )
    return tokenizer, xgr.GrammarCompiler(info)


FUNCTIONS = parse_tools(
    [
        tool(),
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            },
        },
    ]
)
GOOD_CITY, BAD_CITY = '{"city": "Paris"}', '{"city": 3}'
GOOD_ADD, BAD_ADD = '{"a": 1, "b": 2}', '{"a": 1}'
# per format: how one call is written, with [TOOL_CALLS] / [ARGS] as special tokens
WRITTEN = {
    "hermes": lambda n, a: f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>',
    "llama3_json": lambda n, a: f'{{"name": "{n}", "parameters": {a}}}',
    "mistral": lambda n, a: f'[TOOL_CALLS][{{"name": "{n}", "arguments": {a}}}]',
    "mistral_v11": lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{a}",
    "qwen3_coder": lambda n, a: (
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in json.loads(a).items())
        + "</function>\n</tool_call>"
    ),
}


def accepts(compiler: Any, grammar: str | None, text: str) -> bool:
    """Whether the grammar takes `text` (special tokens as tokens) and then ends."""
    import xgrammar as xgr

    assert grammar is not None
    tokenizer, xgr_compiler = compiler
    matcher = xgr.GrammarMatcher(xgr_compiler.compile_structural_tag(grammar))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


@pytest.mark.parametrize("fmt", list(WRITTEN))
def test_grammar_enforces_schema(compiler: Any, fmt: str) -> None:
    tokenizer = compiler[0]
    vocabulary = tokenizer.get_vocab() if fmt == "mistral_v11" else None
    parser = OutputParser(tools=get_tool_parser(fmt.removesuffix("_v11"), vocabulary))
    write = WRITTEN[fmt]
    required = parser.tool_call_grammar(FUNCTIONS, ToolChoice("required"))
    assert required is not None
    assert accepts(compiler, required, write("get_weather", GOOD_CITY))
    assert accepts(compiler, required, write("add", GOOD_ADD))
    if fmt != "qwen3_coder":  # XML: a 3 is a string
        assert not accepts(compiler, required, write("get_weather", BAD_CITY))
    assert not accepts(compiler, required, write("add", BAD_ADD))
    assert not accepts(compiler, required, write("other", GOOD_CITY))
    assert not accepts(compiler, required, "Sure! " + write("add", GOOD_ADD))
    # the turn ends after the calls: nothing but EOS follows them
    assert not accepts(compiler, required, write("add", GOOD_ADD) + " Done.")
    assert parser.tool_call_grammar(FUNCTIONS, AUTO) is None
    # what the grammar lets through parses back into the call
    (call,) = parser.parse(write("add", GOOD_ADD), AUTO, functions=FUNCTIONS).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})


@pytest.mark.parametrize("fmt", [None, *TOOL_PARSERS])
def test_named_grammar_is_the_arguments(compiler: Any, fmt: str | None) -> None:
    """A named tool_choice, with any format or none: the model writes the arguments only (no
    wrapper), valid against the function's schema; the call is written around them."""
    parser = OutputParser(tools=get_tool_parser(fmt) if fmt else None)
    named = ToolChoice("named", "add")
    grammar = parser.tool_call_grammar(FUNCTIONS, named)
    assert accepts(compiler, grammar, GOOD_ADD)
    assert not accepts(compiler, grammar, BAD_ADD)
    assert not accepts(compiler, grammar, GOOD_CITY)
    assert not accepts(compiler, grammar, WRITTEN["hermes"]("add", GOOD_ADD))
    assert not accepts(compiler, grammar, GOOD_ADD + " Done.")
    whole = parser.parse(GOOD_ADD, named, new_id=counter_ids())
    assert whole.content is None
    assert [(c.id, c.name, c.arguments) for c in whole.tool_calls] == [("call_0", "add", GOOD_ADD)]
    for cut in range(len(GOOD_ADD) + 1):  # streamed in two pieces: the same call
        stream = parser.stream(named, new_id=counter_ids())
        first = stream.feed(GOOD_ADD[:cut])
        first.extend(stream.feed(GOOD_ADD[cut:]))
        last = stream.finish()
        first.extend(last)
        assert [c.to_openai() for c in first.tool_calls] == [
            {
                "index": 0,
                "id": "call_0",
                "type": "function",
                "function": {"name": "add", "arguments": GOOD_ADD},
            }
        ]


def test_cut_calls_stay_partial() -> None:
    """A response cut by max_tokens (finish_reason "length") never gets a stand-in for the
    arguments it did not write; one that stopped does ("{}": a call without arguments)."""
    cases = [
        ("hermes", '<tool_call>\n{"name": "now", "arguments": '),
        ("mistral", "[TOOL_CALLS]now"),
        ("qwen3_coder", "<tool_call>\n<function=now>\n<parameter=zone>\nUT"),
    ]
    for fmt, text in cases:
        parser = OutputParser(tools=get_tool_parser(fmt))
        (cut,) = parser.parse(text, AUTO, cut=True).tool_calls
        assert cut.name == "now" and cut.arguments in ("", "{"), (fmt, cut)
        with pytest.raises(ValueError):
            json.loads(cut.arguments)
        stream = parser.stream(AUTO)
        pieces = stream.feed(text)
        pieces.extend(stream.finish(cut=True))
        assert "".join(c.arguments for c in pieces.tool_calls) == cut.arguments
    (stopped,) = OutputParser(tools=get_tool_parser("mistral")).parse(cases[1][1], AUTO).tool_calls
    assert stopped.arguments == "{}"
    # named: cut inside the reasoning, no call; inside the arguments, the text as it is
    thinking = OutputParser(get_reasoning_parser("qwen3"))
    named = ToolChoice("named", "add")
    assert thinking.parse("<think>\nLet me", named, cut=True).tool_calls == []
    (partial,) = thinking.parse('<think>x</think>\n\n{"a": 1', named, cut=True).tool_calls
    assert partial.arguments == '{"a": 1'


def test_grammar_parallel_and_reasoning(compiler: Any) -> None:
    hermes = get_tool_parser("hermes")
    call = WRITTEN["hermes"]
    two = call("add", GOOD_ADD) + "\n" + call("get_weather", GOOD_CITY)
    parser = OutputParser(tools=hermes)
    assert accepts(compiler, parser.tool_call_grammar(FUNCTIONS, ToolChoice("required")), two)
    single = parser.tool_call_grammar(FUNCTIONS, ToolChoice("required"), parallel=False)
    assert not accepts(compiler, single, two)
    thinking = OutputParser(get_reasoning_parser("qwen3"), hermes)
    grammar = thinking.tool_call_grammar(FUNCTIONS, ToolChoice("required"))
    assert accepts(compiler, grammar, "<think>\nAdd them.\n</think>\n\n" + call("add", GOOD_ADD))
    assert accepts(compiler, grammar, call("add", GOOD_ADD))  # thinking is optional
    assert not accepts(compiler, grammar, "<think>\nx\n</think>\n\n" + call("add", BAD_ADD))
    opened = thinking.tool_call_grammar(FUNCTIONS, ToolChoice("required"), in_reasoning=True)
    assert accepts(compiler, opened, "Add them.</think>\n\n" + call("add", GOOD_ADD))
    with pytest.raises(ValueError, match="without a tool call parser"):
        OutputParser().tool_call_grammar(FUNCTIONS, ToolChoice("required"))
