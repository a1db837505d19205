"""The structured extension's HTTP fields (the `request_fields` point): OpenAI's
response_format and SGLang's json_schema / regex / ebnf / structural_tag (xgrammar's format,
{"type": "structural_tag", "format": ...}) as a SamplingParams constraint, the tool calling
fields of a chat request (read by `server.shape_chat`), and the bound on a grammar's size (the
`request_checks` point)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from minisgl.core import CONSTRAINT_KINDS
from minisgl.server.protocol import APIError, Body, ExtensionFields

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what response_format {"type": "json_object"} means
# json_schema (as JSON text), regex, ebnf or structural_tag: compile time grows faster than the
# text (a schema of 5,000 properties, 230 kB, takes ~2 s with a 480-token vocabulary, longer with
# real ones), and the compiler serves every request in turn
MAX_GRAMMAR_CHARS = 65536


class JsonSchemaFormat(Body):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ConstraintFields(ExtensionFields):
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    def params(self, req: Any) -> dict[str, Any]:
        """The SamplingParams constraint (at most one, named as the client did)."""
        given = {k: getattr(self, k) for k in CONSTRAINT_KINDS if getattr(self, k) is not None}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                schema: Any = JSON_OBJECT_SCHEMA
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                message = "response_format.json_schema.schema is required"
                raise APIError(400, message, "response_format")
            else:
                schema = fmt.json_schema.schema_
            given["response_format"] = schema
        if len(given) > 1:
            names = " and ".join(given)
            raise APIError(400, f"give one output constraint, not {names}", next(iter(given)))
        if "response_format" in given:
            return {"json_schema": given.pop("response_format")}
        return given


class ToolFields(ExtensionFields):
    """Tool calling (ChatFeatures.shape_chat reads them from the request)."""

    tools: Any = None
    functions: Any = None  # legacy
    tool_choice: Any = None
    function_call: Any = None  # legacy tool_choice
    parallel_tool_calls: bool | None = None


def tool_fields(req: Any) -> ToolFields:
    """A chat request's tool calling fields (validated once already: `request_extensions`)."""
    extra = req.model_extra or {}
    return ToolFields.model_validate(
        {k: v for k, v in extra.items() if k in ToolFields.model_fields}
    )


def check_grammar_size(msg: Any) -> None:
    """A TokenizeMsg's constraint (as text) within MAX_GRAMMAR_CHARS."""
    for kind in CONSTRAINT_KINDS:
        text = msg.params.get(kind)
        if isinstance(text, str) and len(text) > MAX_GRAMMAR_CHARS:
            message = (
                f"{kind}: at most {MAX_GRAMMAR_CHARS} characters, got {len(text)} "
                "(its compilation would hold up other requests)"
            )
            raise APIError(400, message, kind, "limit_exceeded")


FIELDS: dict[str, list[type[ExtensionFields]]] = {
    "/v1/chat/completions": [ConstraintFields, ToolFields],
    "/v1/completions": [ConstraintFields],
    "/generate": [ConstraintFields],
}
