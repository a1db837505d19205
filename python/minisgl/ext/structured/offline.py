"""`LLM.chat` with tools or parsers: the tools rendered by the chat template, forced calls
constrained by grammar, and each result's text parsed into "content", "reasoning_content" and
"tool_calls" (OpenAI's shapes), as the server returns them. The parsers' `auto` (the default)
is the format each shows in the model's chat template (detect.py), picked once per LLM."""

from __future__ import annotations

import weakref
from typing import Any

from minisgl.core import SamplingParams
from minisgl.ext.structured.detect import AUTO, resolve
from minisgl.ext.structured.options import structured_options
from minisgl.ext.structured.parsers import (
    OutputParser,
    ToolChoice,
    get_reasoning_parser,
    get_tool_parser,
    parse_tools,
    resolve_tool_choice,
)
from minisgl.tokenizer.server import render_chat


def offline_chat(
    llm: Any,
    chats: list[list[dict[str, Any]]],
    params: list[SamplingParams],
    *,
    use_tqdm: bool,
    chat_template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    tool_call_parser: str | None = AUTO,
    reasoning_parser: str | None = AUTO,
) -> list[dict[str, Any]]:
    """`llm.chat` (an LLM) with its keywords; `params`: one per chat. `tool_choice` as OpenAI's
    (default auto with tools): "required" or a named function forces calls by grammar (one
    when not `parallel_tool_calls`); "required" needs a `tool_call_parser` (the calls' format),
    a named function none (the answer is its arguments). Parsers "auto": from the chat
    template (vLLM's names)."""
    tool_call_parser, reasoning_parser = parser_names(llm, tool_call_parser, reasoning_parser)
    functions = parse_tools(tools) if tools else []
    choice = resolve_tool_choice(tool_choice, functions)
    vocabulary = set(llm.tokenizer.get_vocab()) if llm.tokenizer is not None else None
    parser = OutputParser(
        get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
        get_tool_parser(tool_call_parser, vocabulary) if tool_call_parser else None,
    )
    kwargs = dict(chat_template_kwargs)
    if functions:
        kwargs["tools"] = [f.to_openai_tool() for f in functions]
    texts = [render_chat(llm.tokenizer, chat, kwargs) for chat in chats]
    prompts = [llm.tokenizer.encode(text, add_special_tokens=False) for text in texts]
    states = [reasoning_state(parser, t) for t in texts]
    # each chat's params with the grammar of forced calls, or its constraint moved after the
    # reasoning (OutputParser.constrain)
    forced = (functions, choice, parallel_tool_calls) if functions else None
    any_whitespace = structured_options(llm.sched_config).json_any_whitespace
    params = [parser.constrain(p, forced, s, any_whitespace) for p, s in zip(params, states)]
    results = llm.generate(prompts, params, use_tqdm)
    parsed_choice = choice if functions and choice.parses else None
    named = parsed_choice is not None and parsed_choice.mode == "named"
    if tool_call_parser is None and reasoning_parser is None and not named:
        return results
    for state, result in zip(states, results):
        for r in result.get("outputs", [result]):
            parse_into(llm, r, parser, parsed_choice, bool(state), parallel_tool_calls, functions)
    return results


# each LLM's parsers for "auto", detected (and logged) on its first chat
_DETECTED: weakref.WeakKeyDictionary[Any, tuple[str | None, ...]] = weakref.WeakKeyDictionary()


def parser_names(llm: Any, tool: str | None, reasoning: str | None) -> tuple[str | None, ...]:
    """The parser names for LLM.chat's options: `auto` from the chat template, `none` None."""
    if AUTO in (tool, reasoning) and llm not in _DETECTED:
        _DETECTED[llm] = resolve(AUTO, AUTO, llm.tokenizer)
    detected = _DETECTED.get(llm, (None, None))
    chosen = [
        found if value == AUTO else value for value, found in zip((tool, reasoning), detected)
    ]
    return tuple(None if value == "none" else value for value in chosen)


def reasoning_state(parser: OutputParser, prompt: str) -> bool | None:
    """Where the prompt leaves the response (ReasoningParser.prompt_reasoning)."""
    reasoning = parser.reasoning
    if reasoning is None or reasoning.starts_in_reasoning:
        return None
    return reasoning.prompt_reasoning(prompt)


def parse_into(
    llm: Any,
    result: dict[str, Any],
    parser: OutputParser,
    choice: ToolChoice | None,
    in_reasoning: bool,
    parallel: bool,
    functions: list[Any],
) -> None:
    """`result` (one sample of `llm.generate`) with its text parsed."""
    tokenizer = llm.tokenizer
    # tags that are special tokens (Mistral's, Llama's) must survive the decode
    named = choice is not None and choice.mode == "named"
    keep = parser.tools is not None and bool(parser.tools.special_tokens) and not named
    text = tokenizer.decode(result["token_ids"], skip_special_tokens=not keep)
    eos = tokenizer.eos_token
    if keep and eos and text.endswith(eos):
        text = text[: -len(eos)]
    cut = result.get("finish_reason") != "stop"
    parsed = parser.parse(text, choice, in_reasoning, functions=functions, cut=cut)
    calls = parsed.tool_calls if parallel else parsed.tool_calls[:1]
    result["content"], result["reasoning_content"] = parsed.content, parsed.reasoning
    result["tool_calls"] = [call.to_openai() for call in calls]
