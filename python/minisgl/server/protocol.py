"""The HTTP API's request bodies (pydantic models of the OpenAI and native requests), their
checks, and their translation into `SamplingParams`; errors in OpenAI's JSON shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minisgl.core import SamplingParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what response_format {"type": "json_object"} means


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, Any]]:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


class StreamOptions(BaseModel):
    include_usage: bool = False


# Larger integers cannot travel in a message (msgpack) nor live in a tensor: refuse them here.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = -1
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    n: int = Field(1, ge=1, le=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    # structured generation: OpenAI's response_format, or SGLang's json_schema / regex / ebnf
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Int64 | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None


class GenerateRequest(BaseModel):
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False


def grammar_fields(req: SamplingFields) -> dict[str, Any]:
    """The SamplingParams constraint of a request (json_schema, regex or ebnf), if any."""
    given = {
        k: v for k, v in (("json_schema", req.json_schema), ("regex", req.regex), ("ebnf", req.ebnf))
        if v is not None
    }  # fmt: skip
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            schema: Any = JSON_OBJECT_SCHEMA
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema is required", "response_format")
        else:
            schema = fmt.json_schema.schema_
        given["response_format"] = schema
    if len(given) > 1:
        names = " and ".join(given)
        raise APIError(400, f"give one output constraint, not {names}", next(iter(given)))
    if "response_format" in given:
        return {"json_schema": given.pop("response_format")}
    return given


def sampling_params(req: SamplingFields, max_tokens: int, seed_offset: int) -> SamplingParams:
    if max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    # choice i of n samples with seed + i; kept within int64
    seed = None if req.seed is None else (req.seed + seed_offset) % 2**63
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=list(req.stop_token_ids or []),
            seed=seed,
            **grammar_fields(req),
        )
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0]) from None


def native_sampling_fields(req: GenerateRequest) -> tuple[SamplingFields, int]:
    """/generate's sampling_params (native names and defaults) as one choice's fields, and its
    max_tokens."""
    if (req.input_ids is None) == (req.text is None):
        raise APIError(400, "give exactly one of input_ids and text", "input_ids")
    params = {"temperature": 0.0, "max_tokens": 128, **req.sampling_params}
    if "max_new_tokens" in params:  # the native name
        params["max_tokens"] = params.pop("max_new_tokens")
    try:  # a bad value here is the client's error, not the server's (500)
        fields = SamplingFields(**params)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if loc == "max_tokens" and "max_new_tokens" in req.sampling_params:
            loc = "max_new_tokens"
        raise APIError(400, f"sampling_params.{loc}: {err['msg']}", "sampling_params") from None
    if fields.max_tokens is None:
        raise APIError(400, "sampling_params.max_new_tokens must be an integer", "sampling_params")
    fields.n = 1
    return fields, fields.max_tokens


def completion_source(req: CompletionRequest) -> dict[str, Any]:
    """The prompt of a completion request as TokenizeMsg fields: text or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return {"text": None, "input_ids": list(prompt), "chat": None}
    return {"text": prompt, "input_ids": None, "chat": None}


def chat_content(m: ChatMessage) -> str:
    if isinstance(m.content, list):  # OpenAI content parts: keep the text ones
        texts = [p.get("text") for p in m.content if p.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise APIError(400, "messages: a text content part needs a string 'text'", "messages")
        return "".join(texts)  # type: ignore[arg-type]
    return m.content or ""
