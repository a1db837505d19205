"""A chat response parsed whole or streamed: reasoning first (if a reasoning parser is set),
then tool calls in what the reasoning leaves as content (if a tool parser is set and the
request's tool_choice parses); and the grammar that enforces `tool_choice` required / named."""

from __future__ import annotations

import json
from dataclasses import dataclass

from minisgl.parsers.base import IdFactory, ParsedOutput, StreamDelta, ToolStream
from minisgl.parsers.reasoning import ReasoningParser, ReasoningStream
from minisgl.parsers.registry import ToolParser
from minisgl.parsers.schema import FunctionSchema, ToolChoice


class OutputStream:
    """One streamed response: `feed` each text delta, then `finish` once."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, delta: str) -> StreamDelta:
        return self._step(delta, final=False)

    def finish(self) -> StreamDelta:
        return self._step("", final=True)

    def _step(self, delta: str, final: bool) -> StreamDelta:
        reasoning, content = "", delta
        if self.reasoning is not None:
            step = self.reasoning.finish() if final else self.reasoning.feed(delta)
            reasoning, content = step
        if self.tools is None:
            return StreamDelta(content=content, reasoning=reasoning)
        out = self.tools.feed(content) if content else StreamDelta()
        if final:
            out.extend(self.tools.finish())
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
        in_reasoning: bool = False,
        new_id: IdFactory | None = None,
    ) -> OutputStream:
        """A parser for one response: `choice` the request's (None: no tools, no tool parsing),
        `in_reasoning` whether its prompt opened the reasoning (`prompt_opens_reasoning`)."""
        reasoning = self.reasoning.stream(in_reasoning) if self.reasoning else None
        parse_tools = self.tools is not None and choice is not None and choice.parses
        tools = self.tools.stream(new_id) if parse_tools and self.tools else None
        return OutputStream(reasoning, tools)

    def parse(
        self,
        text: str,
        choice: ToolChoice | None = None,
        in_reasoning: bool = False,
        new_id: IdFactory | None = None,
    ) -> ParsedOutput:
        stream = self.stream(choice, in_reasoning, new_id)
        first, last = stream.feed(text), stream.finish()
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
        in_reasoning: bool = False,
    ) -> str | None:
        """The xgrammar structural tag (JSON text, for `compile_structural_tag`) that makes the
        response call the chosen functions with arguments valid against their schemas, after
        the reasoning if there is a reasoning parser; None when `choice` does not constrain."""
        if self.tools is None:
            if choice.mode in ("required", "named"):
                raise ValueError("tool_choice: the server runs without a tool call parser")
            return None
        calls = self.tools.structural_tag(functions, choice, parallel)
        if calls is None:
            return None
        if self.reasoning is not None:
            prefix = self.reasoning.structural_prefix(in_reasoning)
            calls = {"type": "sequence", "elements": [prefix, calls]}
        return json.dumps({"type": "structural_tag", "format": calls}, ensure_ascii=False)
