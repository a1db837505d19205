"""`llama3_json`: Llama 3.1-3.3 JSON tool calls, as their chat template asks ("respond with a
JSON for a function call ... in the format {"name": function name, "parameters": dictionary of
argument name and its value}"):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>` (a special token), several separated by ";". Without the tag
a call is recognised only at the start of the response (JSON later in an answer is an answer).
Llama's built-in tools (`<|python_tag|>brave_search.call(...)`) are not JSON: they stay
content."""

from __future__ import annotations

from typing import Any

from minisgl.ext.structured.parsers.base import IdFactory, ToolStream
from minisgl.ext.structured.parsers.registry import ToolParser, register_tool_parser
from minisgl.ext.structured.parsers.schema import FunctionSchema

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonStream(ToolStream):
    openers = (PYTHON_TAG,)

    def __init__(self, new_id: IdFactory) -> None:
        super().__init__(new_id)
        self.state = self.start

    def start(self) -> bool:
        """A response that opens with "{" (after whitespace) is a call region."""
        start = self.pos
        if not self.skip_whitespace():
            self.pos = start
            return self.final and self.to_content()
        if self.text[self.pos] != "{":
            self.pos = start  # leading whitespace of an answer is content
            return self.to_content()
        self.region_start, self.region_skip = start, self.pos + 1  # reverted: "{" is content
        self.state = self.call_body
        return True

    def open_region(self, opener: str) -> None:
        self.state = self.call_body

    def call_body(self) -> bool:
        return self.call_state(after=self.separator)

    def separator(self) -> bool:
        if not self.skip_whitespace():
            return self.final and self.to_content(after_call=True)
        if self.text[self.pos] == SEPARATOR:
            self.pos += 1
            self.state = self.call_body
            return True
        return self.to_content(after_call=True)


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    stream_class = Llama3JsonStream
    special_tokens = (PYTHON_TAG,)

    def call_format(self, function: FunctionSchema) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{{"name": {self.json_string(function.name)}, "parameters": ',
            "content": self.arguments_format(function),
            "end": "}",
        }

    def calls_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        return self.separated(tags, SEPARATOR + " ", parallel)
