"""`mistral`: Mistral's `[TOOL_CALLS]` (a special token) in its two forms:

- tokenizers before v11 (Mistral 7B v0.3, Mixtral 8x22B, NeMo): a JSON list,
  `[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]`;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): one call per tag,
  `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...` (`[ARGS]` is a special
  token too; without it, the arguments follow the name directly).

Mistral's chat templates require tool call ids of 9 letters and digits: this parser's ids are
so. Constrained output follows the v11 form when the vocabulary has `[ARGS]`."""

from __future__ import annotations

import secrets
import string
from typing import Any

from minisgl.ext.structured.parsers.base import IdFactory, ToolStream
from minisgl.ext.structured.parsers.json_scan import JsonScanner, Scan
from minisgl.ext.structured.parsers.registry import ToolParser, register_tool_parser
from minisgl.ext.structured.parsers.schema import FunctionSchema

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_NAME_CHARS = frozenset(_ALPHANUMERIC + "_-.")


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralStream(ToolStream):
    openers = (TOOL_CALLS,)

    def __init__(self, new_id: IdFactory) -> None:
        super().__init__(new_id)
        self.scanner = JsonScanner()

    def open_region(self, opener: str) -> None:
        self.state = self.region_kind

    def region_kind(self) -> bool:
        start = self.pos
        if not self.skip_whitespace():
            return self.final and self.revert()
        if self.text[self.pos] == "[":
            self.pos += 1
            self.state = self.list_item
        else:
            self.pos = start  # the v11 name follows the tag directly
            self.state = self.name
        return True

    def list_item(self) -> bool:
        return self.call_state(after=self.list_separator)

    def list_separator(self) -> bool:
        if not self.skip_whitespace():
            return self.final and self.to_content(after_call=True)
        ch = self.text[self.pos]
        if ch == ",":
            self.pos += 1
            self.state = self.list_item
            return True
        self.pos += ch == "]"
        return self.to_content(after_call=True)  # anything else after a call is content

    def name(self) -> bool:
        text, end = self.text, self.pos
        while end < len(text) and text[end] in _NAME_CHARS:
            end += 1
        name = text[self.pos : end]
        if end == len(text) and not self.final:
            return False
        rest = text[end : end + len(ARGS)]
        if not self.final and rest != ARGS and ARGS.startswith(rest):
            return False  # "[ARGS" split over deltas
        if not name or not (rest == ARGS or rest[:1] == "{" or end == len(text)):
            return self.revert()
        self.commit(name)
        self.pos = end + (len(ARGS) if rest == ARGS else 0)
        self.scanner, self.state = JsonScanner(), self.arguments_value
        return True

    def arguments_value(self) -> bool:
        text, pos, scanner = self.text, self.pos, self.scanner
        result = Scan.MORE
        while pos < len(text):
            result = scanner.feed(text[pos])
            if result in (Scan.ERROR, Scan.END):
                break
            pos += 1
            if result == Scan.DONE:
                break
        self.send_arguments(self.arguments[-1] + text[self.pos : pos])
        self.pos = pos
        if result == Scan.MORE and not self.final:
            return False
        self.end_call()  # complete, malformed (what follows is content) or truncated
        return self.to_content(after_call=result in (Scan.DONE, Scan.END))


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    stream_class = MistralStream
    special_tokens = (TOOL_CALLS, ARGS)
    new_id = staticmethod(mistral_call_id)

    @property
    def v11(self) -> bool:
        return self.vocabulary is not None and ARGS in self.vocabulary

    def call_format(self, function: FunctionSchema) -> dict[str, Any]:
        arguments = self.arguments_format(function)
        if self.v11:
            elements = [{"type": "token", "token": TOOL_CALLS}]
            elements += [{"type": "const_string", "value": function.name}]
            elements += [{"type": "token", "token": ARGS}, arguments]
            return {"type": "sequence", "elements": elements}
        begin = f'{{"name": {self.json_string(function.name)}, "arguments": '
        return {"type": "tag", "begin": begin, "content": arguments, "end": "}"}

    def calls_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        if self.v11:
            one = {"type": "or", "elements": tags}
            return {"type": "plus", "content": one} if parallel else one
        elements = [{"type": "token", "token": TOOL_CALLS}, {"type": "const_string", "value": "["}]
        elements += [self.separated(tags, ", ", parallel), {"type": "const_string", "value": "]"}]
        return {"type": "sequence", "elements": elements}
