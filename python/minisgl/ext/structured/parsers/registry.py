"""The parser interfaces' registries by name (vLLM's names), and `ToolParser`, the base of
every tool-call format: a format is one module that registers a subclass."""

from __future__ import annotations

import json
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from minisgl.ext.structured.parsers.base import IdFactory, ParsedOutput, ToolStream, random_call_id
from minisgl.ext.structured.parsers.forced import arguments_format
from minisgl.ext.structured.parsers.schema import FunctionSchema

if TYPE_CHECKING:
    from minisgl.ext.structured.parsers.reasoning import ReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}
T = TypeVar("T")


def _register(table: dict[str, Any], name: str) -> Callable[[T], T]:
    def decorate(cls: T) -> T:
        if name in table:
            raise ValueError(f"parser {name!r} registered twice")
        table[name] = cls
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return decorate


def register_tool_parser(name: str) -> Callable[[T], T]:
    return _register(TOOL_PARSERS, name)


def register_reasoning_parser(name: str) -> Callable[[T], T]:
    return _register(REASONING_PARSERS, name)


def _lookup(table: dict[str, T], name: str, what: str) -> T:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; valid names: {', '.join(sorted(table))}")
    return table[name]


def get_tool_parser(name: str, vocabulary: Container[str] | None = None) -> ToolParser:
    """The tool-call parser `name`; `vocabulary` (the tokenizer's token strings) lets a format
    pick its variant. ValueError listing the valid names for an unknown one."""
    return _lookup(TOOL_PARSERS, name, "tool call parser")(vocabulary)


def get_reasoning_parser(name: str) -> ReasoningParser:
    return _lookup(REASONING_PARSERS, name, "reasoning parser")()


class ToolParser:
    """A tool-call format: parses whole responses and streams, and says how calls in this
    format are constrained (xgrammar structural tags) for `tool_choice` required. (A named
    choice needs no format: `forced.py`.)"""

    name: ClassVar[str]
    stream_class: ClassVar[type[ToolStream]]
    # tags that are special tokens: the response must be detokenized with them kept
    special_tokens: ClassVar[tuple[str, ...]] = ()
    new_id: IdFactory = staticmethod(random_call_id)
    arguments_format = staticmethod(arguments_format)

    def __init__(self, vocabulary: Container[str] | None = None) -> None:
        self.vocabulary = vocabulary

    def stream(
        self, new_id: IdFactory | None = None, functions: list[FunctionSchema] | None = None
    ) -> ToolStream:
        """A parser for one streamed response; `functions`: the request's (their schemas)."""
        stream = self.stream_class(new_id or self.new_id)
        stream.schemas = {f.name: f.parameters for f in functions or []}
        return stream

    def parse(self, text: str, new_id: IdFactory | None = None, cut: bool = False) -> ParsedOutput:
        stream = self.stream(new_id)
        content = stream.feed(text).content + stream.finish(cut).content
        return ParsedOutput(content or None, tool_calls=stream.tool_calls)

    def structural_tag(self, functions: list[FunctionSchema], parallel: bool) -> dict[str, Any]:
        """The structural-tag format (xgrammar) of a response that `tool_choice` required
        forces: one or more calls (one when not `parallel`) of the functions, arguments valid
        against their schemas, and nothing after them (the turn ends: EOS, and only there)."""
        if not functions:
            raise ValueError("tool_choice: no function to call")
        return self.calls_format([self.call_format(f) for f in functions], parallel)

    def call_format(self, function: FunctionSchema) -> dict[str, Any]:
        """The structural-tag format of one call of `function`."""
        raise NotImplementedError

    def calls_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """The format of the whole response from the formats of single calls."""
        raise NotImplementedError

    @staticmethod
    def json_string(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    @staticmethod
    def separated(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
        return {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
