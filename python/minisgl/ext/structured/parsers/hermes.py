"""`hermes`: Qwen2.5 / Qwen3 (and Hermes) tool calls, one JSON object per tag, as their chat
templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are several blocks (separated by a newline); text around them is content.
`<tool_call>` is an ordinary (not special) token in these tokenizers."""

from __future__ import annotations

from typing import Any

from minisgl.ext.structured.parsers.base import ToolStream
from minisgl.ext.structured.parsers.registry import ToolParser, register_tool_parser
from minisgl.ext.structured.parsers.schema import FunctionSchema

START, END = "<tool_call>", "</tool_call>"


class HermesStream(ToolStream):
    openers = (START,)

    def open_region(self, opener: str) -> None:
        self.state = self.call_body

    def call_body(self) -> bool:
        return self.call_state(after=self.end_tag)

    def end_tag(self) -> bool:
        return self.closing_tag(END)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    stream_class = HermesStream

    def call_format(self, function: FunctionSchema) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{START}\n{{"name": {self.json_string(function.name)}, "arguments": ',
            "content": self.arguments_format(function),
            "end": "}\n" + END,
        }

    def calls_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        return self.separated(tags, "\n", parallel)
