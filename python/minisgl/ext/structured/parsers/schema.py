"""The request side of tool calling: OpenAI `tools` (and legacy `functions`) validated into
function schemas, and `tool_choice` (legacy `function_call`) resolved against them. Errors are
`ToolSpecError` (a ValueError) whose `param` names the offending field: the HTTP layer answers
400 with it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

# OpenAI's rule for function names, plus "." (MCP servers name their tools so)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolSpecError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class FunctionSchema:
    name: str
    parameters: dict[str, Any]  # a JSON schema of type object
    description: str | None = None
    strict: bool | None = None

    def to_openai_tool(self) -> dict[str, Any]:
        """The `tools` entry as chat templates expect it (`apply_chat_template(tools=...)`)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the function a named choice forces

    @property
    def parses(self) -> bool:
        """Whether responses are parsed for tool calls (`none` returns the raw text)."""
        return self.mode != "none"


def _check_parameters(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return dict(_EMPTY_PARAMETERS)
    if not isinstance(value, dict):
        raise ToolSpecError(param, "must be a JSON schema object")
    if value.get("type", "object") != "object":
        raise ToolSpecError(param, f"must be a schema of type 'object', not {value['type']!r}")
    if "properties" in value and not isinstance(value["properties"], dict):
        raise ToolSpecError(f"{param}.properties", "must be an object")
    required = value.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolSpecError(f"{param}.required", "must be a list of property names")
    return {"type": "object", **value} if "type" not in value else value


def _function(spec: Any, param: str) -> FunctionSchema:
    if not isinstance(spec, dict):
        raise ToolSpecError(param, "must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolSpecError(
            f"{param}.name", "must be 1 to 64 letters, digits, '_', '-' or '.', got " + repr(name)
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolSpecError(f"{param}.description", "must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolSpecError(f"{param}.strict", "must be a boolean")
    parameters = _check_parameters(spec.get("parameters"), f"{param}.parameters")
    return FunctionSchema(name, parameters, description, strict)


def parse_tools(tools: Any = None, functions: Any = None) -> list[FunctionSchema]:
    """The functions of a request's `tools` (or legacy `functions`; not both), validated."""
    if tools is not None and functions is not None:
        raise ToolSpecError("functions", "give tools or the legacy functions, not both")
    field, entries = ("tools", tools) if tools is not None else ("functions", functions)
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ToolSpecError(field, "must be a list")
    result: list[FunctionSchema] = []
    for i, entry in enumerate(entries):
        param = f"{field}[{i}]"
        if field == "tools":
            if not isinstance(entry, dict):
                raise ToolSpecError(param, "must be an object")
            if entry.get("type") != "function":
                raise ToolSpecError(
                    f"{param}.type", f"must be 'function', got {entry.get('type')!r}"
                )
            param, entry = f"{param}.function", entry.get("function")
        function = _function(entry, param)
        if any(f.name == function.name for f in result):
            raise ToolSpecError(f"{param}.name", f"{function.name!r} is given twice")
        result.append(function)
    return result


def _named(choice: dict[str, Any], param: str, names: list[str]) -> ToolChoice:
    if param == "tool_choice":
        if choice.get("type") != "function":
            raise ToolSpecError(f"{param}.type", f"must be 'function', got {choice.get('type')!r}")
        function, param = choice.get("function"), f"{param}.function"
    else:  # legacy function_call: {"name": ...}
        function = choice
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolSpecError(f"{param}.name", "must be a string")
    if name not in names:
        raise ToolSpecError(f"{param}.name", f"{name!r} is not among the given tools")
    return ToolChoice("named", name)


def resolve_tool_choice(
    choice: Any, functions: list[FunctionSchema], param: str = "tool_choice"
) -> ToolChoice:
    """`tool_choice` (or, with param="function_call", the legacy field) against the request's
    functions. Absent: "auto" with tools, "none" without (as OpenAI)."""
    if choice is None:
        return ToolChoice("auto" if functions else "none")
    if not functions:
        raise ToolSpecError(param, "is only allowed when tools are given")
    if isinstance(choice, str):
        allowed = ("none", "auto", "required") if param == "tool_choice" else ("none", "auto")
        if choice not in allowed:
            raise ToolSpecError(param, f"must be one of {', '.join(allowed)} or a named function")
        return ToolChoice(choice)  # type: ignore[arg-type]
    if isinstance(choice, dict):
        return _named(choice, param, [f.name for f in functions])
    raise ToolSpecError(param, "must be a string or an object")
