"""A call the request names (`tool_choice` {"type": "function", "function": {"name": ...}}):
the grammar holds the response (after any reasoning) to that function's arguments, a JSON
object of its parameters schema, and nothing else; the server writes the call around them
(id, name). The model writes no format's wrapper, so this needs no tool call parser.

`ForcedArguments` is the stream of such a response: the call's id and name come with the first
character of the arguments, the arguments as they arrive. A response that ends before any
argument text (cut inside the reasoning) has no call; one cut inside the arguments keeps them as
they are (finish_reason "length" says so)."""

from __future__ import annotations

from typing import Any

from minisgl.ext.structured.parsers.base import IdFactory, ToolStream
from minisgl.ext.structured.parsers.json_scan import WHITESPACE
from minisgl.ext.structured.parsers.schema import FunctionSchema


class ForcedArguments(ToolStream):
    def __init__(self, new_id: IdFactory, name: str) -> None:
        super().__init__(new_id)
        self.name = name
        self.state = self.arguments_state

    def arguments_state(self) -> bool:
        if not self.committed:
            if not self.skip_whitespace():
                return False
            self.commit(self.name)
        # trailing whitespace is withheld (the grammar's JSON ends with "}"; nothing follows)
        end = len(self.text.rstrip(WHITESPACE))
        if end > self.pos:
            self.send_arguments(self.arguments[-1] + self.text[self.pos : end])
            self.pos = end
        self.region_start = self.region_skip = self.pos  # read text can go (ToolStream._run)
        return False


def arguments_format(function: FunctionSchema) -> dict[str, Any]:
    """The structural-tag format of `function`'s arguments: JSON valid against its schema, with
    one whitespace character at most between elements (a sampled model cannot wander into
    endless whitespace)."""
    schema = function.parameters
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def named_format(functions: list[FunctionSchema], name: str | None) -> dict[str, Any]:
    """The format of a named choice's whole answer: the arguments of the function `name`."""
    for function in functions:
        if function.name == name:
            return arguments_format(function)
    raise ValueError("tool_choice: no function to call")
