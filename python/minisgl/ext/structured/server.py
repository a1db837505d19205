"""The API server's tool calling and reasoning: a chat request's `tools` and `tool_choice` (and
the legacy `functions` / `function_call`) validated, earlier calls in its history, the parsers
of --tool-call-parser / --reasoning-parser, and `ChatParsing`, which turns each response's text
into content, reasoning_content and tool_calls and constrains the calls it forces."""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from minisgl.core import SamplingParams
from minisgl.ext.serving.api_tokenizer import with_tokenizer
from minisgl.ext.structured.detect import AUTO, resolve
from minisgl.ext.structured.fields import MAX_GRAMMAR_CHARS, ToolFields, tool_fields
from minisgl.ext.structured.options import chat_options, structured_options
from minisgl.ext.structured.parsers import (
    TOOL_PARSERS,
    FunctionSchema,
    OutputParser,
    OutputStream,
    StreamDelta,
    ToolChoice,
    ToolSpecError,
    get_reasoning_parser,
    get_tool_parser,
    parse_tools,
    resolve_tool_choice,
)
from minisgl.server.protocol import APIError, ChatRequest
from minisgl.tokenizer.server import needed, render_chat


@dataclass
class ChatParsing:
    """How a chat response's text becomes content, reasoning_content and tool_calls, and what
    constrains it: `choice` None parses no tool calls; `in_reasoning`: the prompt opened the
    reasoning (True), closed it (False: thinking off) or neither (None); `parallel` false keeps
    the first call only (and a forced call is one call); `forced`: the request's functions when
    its tool_choice (or legacy function_call: `choice_param`) forces calls (a named one: the
    response is the arguments, the call is written here); `functions`: the request's (a format
    may read their schemas);
    `keep_special_tokens`: the tool format's tags are special tokens, so the response is
    detokenized with them; `strip`: then the special tokens (EOS) removed from the end of a
    stopped response. `legacy`: the request gave `functions`, so the reply has the legacy
    shape (one `function_call`, finish_reason "function_call") as OpenAI's deprecated API.
    `any_whitespace`: --json-any-whitespace, for a constraint moved after the reasoning."""

    parser: OutputParser
    choice: ToolChoice | None
    in_reasoning: bool | None
    parallel: bool = True
    keep_special_tokens: bool = False
    strip: tuple[str, ...] = ()
    forced: list[FunctionSchema] = field(default_factory=list)
    choice_param: str = "tool_choice"
    legacy: bool = False
    any_whitespace: bool = False
    functions: list[FunctionSchema] = field(default_factory=list)
    streams: dict[int, OutputStream] = field(default_factory=dict)  # per streamed choice

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """A choice's params with the grammar of its forced calls, or with its output
        constraint moved after the reasoning (OutputParser.constrain)."""
        forced = None
        if self.forced and self.choice is not None:
            forced = (self.forced, self.choice, self.parallel)
        try:
            params = self.parser.constrain(params, forced, self.in_reasoning, self.any_whitespace)
        except ValueError as e:
            message = str(e).replace("tool_choice", self.choice_param, 1)
            raise APIError(400, message, self.choice_param if forced else None) from None
        grammar = params.get("structural_tag") or ""
        if forced and len(grammar) > MAX_GRAMMAR_CHARS:  # the tools' schemas, compiled
            message = (
                f"tools: the grammar of the forced calls has at most {MAX_GRAMMAR_CHARS} "
                f"characters, got {len(grammar)} (its compilation would hold up other requests)"
            )
            raise APIError(400, message, "tools", "limit_exceeded")
        return params

    def final_text(self, text: str, finish_reason: str | None) -> str:
        if finish_reason == "stop":
            for token in self.strip:
                if token and text.endswith(token):
                    return text[: -len(token)]
        return text

    def finish(self, finish_reason: str | None, called: bool) -> str | None:
        if not called or finish_reason != "stop":
            return finish_reason
        return "function_call" if self.legacy else "tool_calls"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole response's message, and its finish_reason. A call cut by max_tokens keeps
        its arguments as they are (finish_reason "length")."""
        text, cut = self.final_text(text, finish_reason), finish_reason != "stop"
        parsed = self.parser.parse(
            text, self.choice, self.in_reasoning, functions=self.functions, cut=cut
        )
        calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self.parser.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if calls and self.legacy:
            message["function_call"] = calls[0].to_openai()["function"]
        elif calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, self.finish(finish_reason, bool(calls))

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """Choice `index`'s stream delta for the next piece of text (the last piece:
        `finish_reason` set, which flushes what the parsers held back), and its finish_reason."""
        stream = self.streams.get(index)
        if stream is None:
            stream = self.parser.stream(self.choice, self.in_reasoning, functions=self.functions)
            self.streams[index] = stream
        piece = stream.feed(self.final_text(text, finish_reason)) if text else StreamDelta()
        if finish_reason is not None:
            piece.extend(stream.finish(cut=finish_reason != "stop"))
        delta: dict[str, Any] = {}
        if piece.content:
            delta["content"] = piece.content
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        calls = [c.to_openai() for c in piece.tool_calls if self.parallel or c.index == 0]
        if calls and self.legacy:
            delta["function_call"] = calls[0]["function"]
        elif calls:
            delta["tool_calls"] = calls
        return delta, self.finish(finish_reason, stream.has_tool_calls)


def packable(value: Any, param: str) -> None:
    """A 400 for what cannot travel in a message (msgpack): integers beyond 64 bits."""
    try:
        msgpack.packb(value)
    except (OverflowError, TypeError, ValueError):
        raise APIError(400, f"{param}: integers must fit in 64 bits", param) from None


def chat_tools(req: ToolFields) -> tuple[list[FunctionSchema], ToolChoice]:
    """The request's functions (`tools` or legacy `functions`) and its tool choice (`tool_choice`
    or legacy `function_call`), validated: a 400 names the offending field. `required` and named
    choices are enforced by a grammar (ChatParsing.constrain)."""
    try:
        functions = parse_tools(req.tools, req.functions)
        if req.tool_choice is not None and req.function_call is not None:
            raise ToolSpecError("function_call", "give tool_choice or the legacy function_call")
        if req.function_call is not None:
            choice = resolve_tool_choice(req.function_call, functions, "function_call")
        else:
            choice = resolve_tool_choice(req.tool_choice, functions)
    except ToolSpecError as e:
        raise APIError(400, str(e), e.param) from None
    for f in functions:  # the schemas travel to a tokenizer worker in a message (msgpack)
        packable(f.parameters, "tools" if req.tools is not None else "functions")
    return functions, choice


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """/tokenize's `tools`, validated, as the chat template takes them."""
    try:
        return [f.to_openai_tool() for f in parse_tools(tools)] or None
    except ToolSpecError as e:
        raise APIError(400, str(e), e.param) from None


def history_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, checked, with the arguments as an object: the
    templates of Qwen, Llama and Mistral render `arguments | tojson` (as transformers documents
    them), which would quote a JSON string again."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", "messages")
    result = []
    for j, call in enumerate(calls):
        param = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            message = f"{param}: must be {{'type': 'function', 'function': {{'name': ...}}}}"
            raise APIError(400, message, "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                message = f"{param}.function.arguments: not valid JSON"
                raise APIError(400, message, "messages") from None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{param}.function.arguments: must be an object", "messages")
        packable(arguments, "messages")
        entry = {**call, "type": "function", "function": {**function, "arguments": arguments}}
        result.append(entry)
    return result


# each API server's parsers and its tokenizer's special tokens, made on its first chat
_PARSERS: weakref.WeakKeyDictionary[Any, tuple[OutputParser, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


async def output_parser(api: Any) -> tuple[OutputParser, tuple[str, ...]]:
    """The server's parsers, made on first use (a tool format may look at the vocabulary), and
    the tokenizer's special tokens when there is a tool format (None of them otherwise). An
    `auto` left in the args (a server not started by the launcher, which resolves them) is
    resolved here, from the API process's tokenizer."""
    if api not in _PARSERS:
        options = chat_options(api.args)
        if AUTO in (options.tool_call_parser, options.reasoning_parser):
            chosen = await with_tokenizer(
                api,
                lambda tok: resolve(options.tool_call_parser, options.reasoning_parser, tok),
                "model",
            )
            options.tool_call_parser, options.reasoning_parser = chosen
        name, reasoning = options.tool_call_parser, options.reasoning_parser
        tools, special_tokens = None, tuple[str, ...]()
        if name is not None:

            def vocabulary(tok: Any) -> tuple[set[str], tuple[str, ...]]:
                return set(needed(tok).get_vocab()), tuple(tok.all_special_tokens)

            vocab, special_tokens = await with_tokenizer(api, vocabulary, "model")
            tools = get_tool_parser(name, vocab)
        parser = OutputParser(get_reasoning_parser(reasoning) if reasoning else None, tools)
        _PARSERS[api] = (parser, special_tokens)
    return _PARSERS[api]


async def shape_chat(
    req: ChatRequest, chat: list[dict[str, Any]], api: Any
) -> tuple[list[dict[str, Any]] | None, ChatParsing | None]:
    """The request's tools as the template takes them, and how its responses are parsed (None:
    returned as the raw text)."""
    fields = tool_fields(req)
    functions, choice = chat_tools(fields)
    tools = [f.to_openai_tool() for f in functions] or None
    kwargs = dict(req.chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    render = lambda tok: render_chat(tok, chat, kwargs)  # noqa: E731
    return tools, await chat_parsing(api, fields, functions, choice, render)


async def chat_parsing(
    api: Any,
    req: ToolFields,
    functions: list[FunctionSchema],
    choice: ToolChoice,
    render: Callable[[Any], str],
) -> ChatParsing | None:
    """How the responses of `req` are parsed; None: returned as the raw text. `render`
    renders the prompt, whose end may open the reasoning (a template that thinks by
    default ends it with the start tag)."""
    parser, special_tokens = await output_parser(api)
    tool_choice = choice if functions and choice.parses else None
    named = tool_choice is not None and tool_choice.mode == "named"
    if tool_choice is not None and not named and parser.tools is None:
        param = "tools" if req.tools is not None else "functions"
        message = (
            f"{param}: this server has no tool call parser (--tool-call-parser none, or auto "
            "and no tool call format was recognised in the model's chat template), so the "
            "model's calls cannot be returned; start it with --tool-call-parser NAME (one of "
            f"{', '.join(sorted(TOOL_PARSERS))}), name the function in tool_choice, or give "
            "tool_choice 'none' to only show the tools to the model"
        )
        raise APIError(400, message, param)
    if parser.reasoning is None and tool_choice is None:
        return None
    in_reasoning = None
    if parser.reasoning is not None and not parser.reasoning.starts_in_reasoning:
        prompt = await with_tokenizer(api, render, "messages")
        in_reasoning = parser.reasoning.prompt_reasoning(prompt)
    tags = parser.tools.special_tokens if parser.tools is not None and not named else ()
    keep = tool_choice is not None and bool(tags)  # the format's tags must survive the decode
    strip = tuple(t for t in special_tokens if t not in tags) if keep else ()
    legacy = req.tools is None and req.functions is not None  # one call, the legacy reply
    return ChatParsing(
        parser,
        tool_choice,
        in_reasoning,
        parallel=req.parallel_tool_calls is not False and not legacy,
        keep_special_tokens=keep,
        strip=strip,
        forced=functions if choice.mode in ("required", "named") else [],
        choice_param="function_call" if req.function_call is not None else "tool_choice",
        legacy=legacy,
        any_whitespace=structured_options(api.args.scheduler).json_any_whitespace,
        functions=functions,
    )
