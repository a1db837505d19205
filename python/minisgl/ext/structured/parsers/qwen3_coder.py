"""`qwen3_coder`: Qwen3-Coder's (and Qwen3.5's) XML tool calls, as their chat template teaches:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text (one newline after its tag and one before its end tag frame it).
It becomes JSON by the function's schema, as vLLM's parser does: a property of type string
stays a string; any other value is read as JSON when it parses, else kept as a string. So the
arguments are a JSON object like every other format's; a stream sends "{" with the name, each
parameter once its end tag is read, and "}" at `</function>`. `<tool_call>` is an ordinary
token; a call that starts directly at `<function=` is taken too."""

from __future__ import annotations

import json
import re
from typing import Any

from minisgl.ext.structured.parsers.base import IdFactory, ToolStream
from minisgl.ext.structured.parsers.registry import ToolParser, register_tool_parser
from minisgl.ext.structured.parsers.schema import FunctionSchema

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _no_constant(name: str) -> Any:
    raise ValueError(name)  # NaN, Infinity: not JSON


def json_value(text: str, schema: dict[str, Any]) -> str:
    """A parameter's text as a JSON value, by its property `schema`."""
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return json.dumps(text, ensure_ascii=False)
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return json.dumps(text, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


class Qwen3CoderStream(ToolStream):
    openers = (TOOL_CALL, FUNCTION)

    def __init__(self, new_id: IdFactory) -> None:
        super().__init__(new_id)
        self.wrapped = False  # the call opened with <tool_call>: its end tag follows
        self.parameter = ""
        self.count = 0  # parameters of the current call so far

    def open_region(self, opener: str) -> None:
        self.wrapped = opener == TOOL_CALL
        self.state = self.function_tag if self.wrapped else self.function_name

    def function_tag(self) -> bool:
        if not self.skip_whitespace():
            return self.final and self.revert()
        found = self.literal(FUNCTION)
        if found is None:
            return False
        if not found:
            return self.revert()
        self.pos += len(FUNCTION)
        self.state = self.function_name
        return True

    def read_name(self) -> str | None:
        """`NAME>` at pos: the name (consumed with its ">"), None while more text may complete
        it, "" when it is malformed."""
        match = _NAME.match(self.text, self.pos)
        end = match.end() if match else self.pos
        if end == len(self.text):
            return "" if self.final else None
        if end == self.pos or self.text[end] != ">":
            return ""
        name, self.pos = self.text[self.pos : end], end + 1
        return name

    def function_name(self) -> bool:
        name = self.read_name()
        if name is None:
            return False
        if not name:
            return self.revert()
        self.commit(name)
        self.count = 0
        self.send_arguments("{")
        self.state = self.body
        return True

    def body(self) -> bool:
        """Inside a function: a parameter, or its end."""
        if not self.skip_whitespace():
            return self.final and self.fail()
        for tag, state in ((PARAMETER, self.parameter_name), (FUNCTION_END, self.close)):
            found = self.literal(tag)
            if found is None:
                return False
            if found:
                self.pos += len(tag)
                self.state = state
                return True
        return self.fail()

    def parameter_name(self) -> bool:
        name = self.read_name()
        if name is None:
            return False
        if not name:
            return self.fail()
        self.parameter, self.state = name, self.parameter_value
        return True

    def parameter_value(self) -> bool:
        end = self.text.find(PARAMETER_END, self.pos)
        if end < 0:
            return self.final and self.fail()
        value = self.text[self.pos : end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        function = self.schemas.get(self.names[-1], {})
        schema = function.get("properties", {}).get(self.parameter, {})
        entry = f"{json.dumps(self.parameter, ensure_ascii=False)}: {json_value(value, schema)}"
        self.send_arguments(self.arguments[-1] + (", " if self.count else "") + entry)
        self.count += 1
        self.pos, self.state = end + len(PARAMETER_END), self.body
        return True

    def close(self) -> bool:
        self.send_arguments(self.arguments[-1] + "}")
        self.end_call()
        if self.wrapped:
            self.state = self.end_tag
            return True
        return self.to_content(after_call=True)

    def end_tag(self) -> bool:
        return self.closing_tag(TOOL_CALL_END)

    def fail(self) -> bool:
        """Malformed XML ends the call with the parameters read so far, closed; a response
        cut inside it leaves them open (the call is not complete). At the end of the text, what
        is left of the call (a parameter without its end tag) is the call's, not content."""
        if self.committed and not (self.final and self.cut):
            self.send_arguments(self.arguments[-1] + "}")
        if self.committed and self.final:
            self.pos = len(self.text)
        return super().fail()


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    stream_class = Qwen3CoderStream

    def call_format(self, function: FunctionSchema) -> dict[str, Any]:
        content = {"type": "json_schema", "json_schema": function.parameters, "style": "qwen_xml"}
        return {
            "type": "tag",
            "begin": f"{TOOL_CALL}\n{FUNCTION}{function.name}>\n",
            "content": content,
            "end": f"\n{FUNCTION_END}\n{TOOL_CALL_END}",
        }

    def calls_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        return self.separated(tags, "\n", parallel)
