"""A chat response parsed whole or streamed: reasoning first (if a reasoning parser is set),
then tool calls in what the reasoning leaves as content (if a tool parser is set and the
request's tool_choice parses: the format's calls, or the one call a named choice forces, whose
arguments are all the answer); and the grammars (xgrammar structural tags) that enforce
`tool_choice` required / named and that hold an output constraint off until the reasoning ends."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from minisgl.core import SamplingParams
from minisgl.ext.structured.grammar import grammar_key
from minisgl.ext.structured.parsers.base import (
    IdFactory,
    ParsedOutput,
    StreamDelta,
    ToolStream,
    random_call_id,
)
from minisgl.ext.structured.parsers.forced import ForcedArguments, named_format
from minisgl.ext.structured.parsers.reasoning import ReasoningParser, ReasoningStream
from minisgl.ext.structured.parsers.registry import ToolParser
from minisgl.ext.structured.parsers.schema import FunctionSchema, ToolChoice

# what a request's tools force: its functions, tool choice and parallel_tool_calls
ToolConstraint = tuple[list[FunctionSchema], ToolChoice, bool]


class OutputStream:
    """One streamed response: `feed` each text delta, then `finish` once."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, delta: str) -> StreamDelta:
        return self._step(delta, final=False)

    def finish(self, cut: bool = False) -> StreamDelta:
        """`cut`: the response was cut (not "stop"): an open call stays as it is."""
        return self._step("", final=True, cut=cut)

    def _step(self, delta: str, final: bool, cut: bool = False) -> StreamDelta:
        reasoning, content = "", delta
        if self.reasoning is not None:
            step = self.reasoning.finish() if final else self.reasoning.feed(delta)
            reasoning, content = step
        if self.tools is None:
            return StreamDelta(content=content, reasoning=reasoning)
        out = self.tools.feed(content) if content else StreamDelta()
        if final:
            out.extend(self.tools.finish(cut))
        out.reasoning = reasoning
        return out

    @property
    def has_tool_calls(self) -> bool:
        """Whether a call was made (finish_reason "tool_calls")."""
        return self.tools is not None and bool(self.tools.ids)


@dataclass(frozen=True)
class OutputParser:
    """The server's parsers (either may be None); `tool_choice` none skips the tool parser."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None

    def stream(
        self,
        choice: ToolChoice | None = None,
        in_reasoning: bool | None = False,
        new_id: IdFactory | None = None,
        functions: list[FunctionSchema] | None = None,
    ) -> OutputStream:
        """A parser for one response: `choice` the request's (None: no tools, no tool parsing),
        `in_reasoning` whether its prompt opened the reasoning (`prompt_opens_reasoning`),
        `functions` the request's (a format may read their schemas)."""
        reasoning = self.reasoning.stream(in_reasoning) if self.reasoning else None
        tools: ToolStream | None = None
        if choice is not None and choice.mode == "named" and choice.name is not None:
            ids = new_id or (self.tools.new_id if self.tools else random_call_id)
            tools = ForcedArguments(ids, choice.name)
        elif self.tools is not None and choice is not None and choice.parses:
            tools = self.tools.stream(new_id, functions)
        return OutputStream(reasoning, tools)

    def parse(
        self,
        text: str,
        choice: ToolChoice | None = None,
        in_reasoning: bool | None = False,
        new_id: IdFactory | None = None,
        functions: list[FunctionSchema] | None = None,
        cut: bool = False,
    ) -> ParsedOutput:
        """A whole response; `cut`: it ended before the model did (OutputStream.finish)."""
        stream = self.stream(choice, in_reasoning, new_id, functions)
        first, last = stream.feed(text), stream.finish(cut)
        content = first.content + last.content
        reasoning = first.reasoning + last.reasoning
        calls = stream.tools.tool_calls if stream.tools else []
        return ParsedOutput(content or None, reasoning or None, calls)

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        return self.reasoning is not None and self.reasoning.prompt_opens_reasoning(prompt)

    def tool_call_grammar(
        self,
        functions: list[FunctionSchema],
        choice: ToolChoice,
        parallel: bool = True,
        in_reasoning: bool | None = None,
    ) -> str | None:
        """The xgrammar structural tag (JSON text, for `compile_structural_tag`) that makes the
        response call the chosen functions with arguments valid against their schemas, after
        the reasoning if there is a reasoning parser (`in_reasoning`: `prompt_reasoning`'s);
        None when `choice` does not constrain. A named choice: the arguments alone (any
        model); required: the format's calls, then the end of the turn."""
        if choice.mode == "named":
            return self._after_reasoning(named_format(functions, choice.name), in_reasoning)
        if choice.mode != "required":
            return None
        if self.tools is None:
            raise ValueError(
                "tool_choice: required calls cannot be enforced without a tool call parser "
                "(the format of the calls)"
            )
        calls = self.tools.structural_tag(functions, parallel)
        return self._after_reasoning(calls, in_reasoning)

    def answer_grammar(
        self, kind: str, text: str, in_reasoning: bool | None = None, any_whitespace: bool = False
    ) -> str | None:
        """The structural tag that applies an output constraint (`kind` json_schema, regex or
        ebnf, as SamplingParams holds it) to the answer after the reasoning, not to the
        thinking; None when it applies as it is: no reasoning parser, or the prompt closed the
        reasoning (thinking off). `any_whitespace`: as GrammarCompiler's; otherwise JSON has
        one whitespace character at most between elements (the least a structural tag's JSON
        allows: compact separators cannot be expressed there)."""
        prefix = self.reasoning.structural_prefix(in_reasoning) if self.reasoning else None
        if prefix is None:
            return None
        answer: dict[str, Any]
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise ValueError(f"json_schema is not JSON: {e}") from None
            answer = {"type": "json_schema", "json_schema": schema}
            if not any_whitespace:
                answer["max_whitespace_cnt"] = 1
        elif kind == "regex":
            answer = {"type": "regex", "pattern": text}
        elif kind == "ebnf":
            answer = {"type": "grammar", "grammar": text}
        else:
            raise ValueError(f"{kind}: cannot be applied after the reasoning")
        return self._after_reasoning(answer, in_reasoning)

    def _after_reasoning(self, answer: dict[str, Any], in_reasoning: bool | None) -> str:
        prefix = self.reasoning.structural_prefix(in_reasoning) if self.reasoning else None
        if prefix is not None:
            answer = {"type": "sequence", "elements": [prefix, answer]}
        return json.dumps({"type": "structural_tag", "format": answer}, ensure_ascii=False)

    def constrain(
        self,
        params: SamplingParams,
        tools: ToolConstraint | None = None,
        in_reasoning: bool | None = None,
        any_whitespace: bool = False,
    ) -> SamplingParams:
        """`params` with the constraint the response must follow: the calls that `tools`
        forces (tool_choice required / named), or the output constraint `params` already has,
        moved after the reasoning. ValueError (naming tool_choice) for a forced call beside
        another output constraint."""
        given = grammar_key(params)
        if tools is not None:
            grammar = self.tool_call_grammar(*tools, in_reasoning=in_reasoning)
            if grammar is not None:
                if given is not None:
                    raise ValueError(
                        f"tool_choice: {tools[1].mode!r} forces tool calls, which cannot be "
                        f"combined with another output constraint ({given[0]})"
                    )
                return dataclasses.replace(params, ext={**params.ext, "structural_tag": grammar})
        if given is None or given[0] == "structural_tag":
            return params
        grammar = self.answer_grammar(*given, in_reasoning, any_whitespace)
        if grammar is None:
            return params
        return dataclasses.replace(
            params, ext={**params.ext, given[0]: None, "structural_tag": grammar}
        )
