"""The OpenAPI document (/openapi.json, /docs) as the server answers (the `routes` point):
FastAPI documents a 422 for a validation error (answered 400 here) and no other error; here
every route gets the error statuses it answers, the OpenAI-shaped error body, and the
event-stream answer of the routes that stream."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from minisgl.extension import extensions

ERROR_STATUSES = {
    400: "invalid request: the error names the field (FastAPI's 422 is answered 400, as OpenAI)",
    401: "missing or wrong API key (--api-key)",
    404: "the model named is not served here, or no stored object has that id",
    408: "the body did not arrive within --timeout-body-read",
    413: "body larger than --max-request-bytes",
    500: "internal error",
    503: "overloaded (--max-queued-requests, or --max-connections requests in progress), "
    "shutting down, or a worker died or hung (the "
    "watchdog); /health?generate=1: the one-token generation failed or took too long",
    504: "the request ran past --request-timeout",
}
ERROR_SCHEMA: dict[str, Any] = {  # error_body's
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}


# the error body of the paths whose API has its own shape (`error_bodies`: Anthropic's
# {"type": "error", "error": {"type", "message"}}): what every shape has in common
OTHER_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
        }
    },
}
GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages"}
)


def error_statuses(path: str, method: str) -> set[int]:
    """The error statuses an endpoint answers."""
    statuses = {500} | ({400, 503} if path == "/health" else {401, 503})  # 400: `generate`
    if method == "post":
        statuses |= {400, 408, 413, 404}  # 404: "model" unknown; 408: a body too slow
    if path == "/flush_cache":
        statuses |= {400, 503}  # cache_busy; the pipeline is gone
    if path == "/health_generate":
        statuses |= {503}
    if path in GENERATION_PATHS:
        statuses |= {503, 504}
    if "{" in path:  # a stored object's id (GET /v1/responses/{response_id}): unknown
        statuses |= {404}
    return statuses


STREAMING_PATHS = GENERATION_PATHS
# Before OpenAPI 3.2, a text/event-stream `schema` describes one event (its SSE fields), not the
# stream; every event minisgl sends is one `data:` line of JSON (or `[DONE]`).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def document_errors(app: FastAPI) -> None:
    """Make the OpenAPI document say what the server answers: FastAPI documents a 422 for a
    validation error (answered 400 here) and no other error."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components["ErrorResponse"] = ERROR_SCHEMA
        components["OtherErrorResponse"] = OTHER_ERROR_SCHEMA
        for path, operations in schema.get("paths", {}).items():
            other = path in extensions().error_bodies
            ref = {"$ref": f"#/components/schemas/{'Other' if other else ''}ErrorResponse"}
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if path in STREAMING_PATHS and "200" in responses:  # with "stream": true
                    events = {"schema": SSE_EVENT_SCHEMA}
                    responses["200"].setdefault("content", {})["text/event-stream"] = events
                for status in sorted(error_statuses(path, method)):
                    content = {"application/json": {"schema": ref}}
                    responses[str(status)] = {
                        "description": ERROR_STATUSES[status],
                        "content": content,
                    }
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_openapi_errors(app: FastAPI, api: Any, info: dict[str, Any]) -> None:
    document_errors(app)
