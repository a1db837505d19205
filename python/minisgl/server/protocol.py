"""The HTTP API's request bodies (pydantic models of the OpenAI and native requests), their
checks, and their translation into `SamplingParams`; errors in OpenAI's JSON shape."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgpack
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

from minisgl.core import CONSTRAINT_KINDS, MAX_LOGPROBS, SamplingParams
from minisgl.parsers import (
    FunctionSchema,
    ToolChoice,
    ToolSpecError,
    parse_tools,
    resolve_tool_choice,
)

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


MAX_CHOICES = 1024  # prompts x n of one completion request (n alone: at most 64)


class StreamOptions(BaseModel):
    include_usage: bool = False


# Larger integers cannot travel in a message (msgpack) nor live in a tensor: refuse them here.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
# a token id: a JSON integer, never a boolean (lax ints take `false` for 0) nor a string
TokenId = Annotated[int, Strict(), Field(ge=-(2**63), lt=2**63)]


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
    stop_token_ids: list[TokenId] | None = None
    n: int = Field(1, ge=1, le=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    # structured generation: OpenAI's response_format, or SGLang's json_schema / regex / ebnf /
    # structural_tag (xgrammar's format, {"type": "structural_tag", "format": ...})
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    # logit adjustments: OpenAI's, plus repetition_penalty and min_tokens as vLLM spells them
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    min_tokens: Int64 = 0
    priority: Int64 = 0  # --schedule-policy priority: lower values first (vLLM's field)


# OpenAI fields minisgl cannot honour yet: a 400 naming the field unless given an "off" value
NOT_SUPPORTED = {
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
}
COMPLETION_NOT_SUPPORTED = {
    "suffix": "suffixes (insertion)",
    "best_of": "best_of",
}
# values that ask for nothing (compared by identity first: 0 is not False)
OFF_VALUES: tuple[Any, ...] = ("", [], {})
OFF_PAIRS = (("best_of", 1),)
# OpenAI fields that change nothing in what this server computes: accepted without a warning
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier"})


class OpenAIRequest(SamplingFields):
    # fields not declared here are kept (model_extra) to be refused or warned about: `extra_fields`
    model_config = ConfigDict(extra="allow")


# top alternatives per token: OpenAI's limit is 5 (completions) and 20 (chat); vLLM's 20 for both
TopLogprobs = Annotated[int | None, Field(None, ge=0, le=MAX_LOGPROBS)]


class CompletionRequest(OpenAIRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    echo: bool = False  # the prompt before the completion (and its logprobs, with `logprobs`)
    logprobs: TopLogprobs = None  # the sampled tokens' logprobs, with this many alternatives


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


# apply_chat_template's own arguments: a client may not replace the template nor its output
# (tools come from the request's own field)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "chat_template", "tokenize", "return_dict", "tools"}
)


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS.intersection(value or {})):
        raise ValueError(f"{', '.join(reserved)} cannot be set here")
    try:  # it travels to a tokenizer worker in a message (msgpack)
        msgpack.packb(value)
    except (OverflowError, TypeError, ValueError):
        raise ValueError("integers must fit in 64 bits") from None
    return value


# extra keyword arguments of the chat template (e.g. enable_thinking)
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)]


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    chat_template_kwargs: TemplateKwargs = None
    logprobs: bool = False
    top_logprobs: TopLogprobs = None
    # tool calling: checked by `chat_tools` (parse_tools names the offending field)
    tools: Any = None
    functions: Any = None  # legacy
    tool_choice: Any = None
    function_call: Any = None  # legacy tool_choice
    parallel_tool_calls: bool | None = None

    def logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: None unless asked (top_logprobs alone is a mistake)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    tools: Any = None  # rendered as in a chat request


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]


class GenerateRequest(BaseModel):
    # SGLang's other fields (sglang-router passes them on) are kept to be checked:
    # `sglang_compat.check_generate_extras`
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    data_parallel_rank: Int64 | None = None  # the --dp replica to run on (SGLang's)
    input_ids: list[TokenId] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    priority: Int64 | None = None  # SGLang's place for it (sampling_params' too)


def grammar_fields(req: SamplingFields) -> dict[str, Any]:
    """The SamplingParams constraint of a request (json_schema, regex, ebnf or structural_tag),
    if any."""
    given = {k: getattr(req, k) for k in CONSTRAINT_KINDS if getattr(req, k) is not None}
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


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    seed_offset: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    echo: bool = False,
) -> SamplingParams:
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        message = f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}"
        raise APIError(400, message, "max_tokens")
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=list(req.stop_token_ids or []),
            seed=req.seed,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias or {},  # type: ignore[arg-type]  # string keys: converted
            min_tokens=req.min_tokens,
            priority=req.priority,
            stop=req.stop or [],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **grammar_fields(req),
        ).for_sample(seed_offset)  # choice i of n samples with seed + i
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0]) from None


def native_sampling_fields(req: GenerateRequest) -> tuple[SamplingFields, int]:
    """/generate's sampling_params (native names and defaults) as one choice's fields, and its
    max_tokens."""
    if (req.input_ids is None) == (req.text is None):
        raise APIError(400, "give exactly one of input_ids and text", "input_ids")
    params = {"temperature": 0.0, "max_tokens": 128, **req.sampling_params}
    if req.priority is not None:
        params["priority"] = req.priority
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


def completion_sources(req: CompletionRequest) -> list[dict[str, Any]]:
    """The prompts of a completion request as TokenizeMsg fields (text or token ids), one per
    prompt: a string, token ids, or a batch of either."""
    prompts: list[Any] = [req.prompt]
    if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
        prompts = list(req.prompt)
    if not prompts or len(prompts) * req.n > MAX_CHOICES:
        message = f"give 1 to {MAX_CHOICES // req.n} prompts (n={req.n}), got {len(prompts)}"
        raise APIError(400, message, "prompt")
    return [
        {"text": None, "input_ids": list(p), "chat": None}
        if isinstance(p, list)
        else {"text": p, "input_ids": None, "chat": None}
        for p in prompts
    ]


def extra_fields(req: OpenAIRequest, not_supported: dict[str, str]) -> list[str]:
    """Refuse the fields of `not_supported` that the request turns on; the names of the other
    undeclared fields, which are ignored (the caller warns)."""
    extra = req.model_extra or {}
    for name, value in extra.items():
        off = value is None or value is False or value in OFF_VALUES or (name, value) in OFF_PAIRS
        if name in not_supported and not off:
            what = not_supported[name]
            raise APIError(400, f"{name}: {what} is not supported", name, "unsupported_parameter")
    return sorted(n for n in extra if n not in not_supported and n not in NO_EFFECT)


def chat_max_tokens(req: ChatRequest) -> int | None:
    """max_completion_tokens (OpenAI's newer name) or max_tokens; both only when they agree."""
    new, old = req.max_completion_tokens, req.max_tokens
    if new is not None and new < 1:  # named as given, not as the max_tokens it stands for
        message = f"max_completion_tokens must be at least 1, got {new}"
        raise APIError(400, message, "max_completion_tokens")
    if new is not None and old is not None and new != old:
        message = f"max_completion_tokens ({new}) and max_tokens ({old}) differ: give one"
        raise APIError(400, message, "max_completion_tokens")
    return new if new is not None else old


CHAT_ROLES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def packable(value: Any, param: str) -> None:
    """A 400 for what cannot travel in a message (msgpack): integers beyond 64 bits."""
    try:
        msgpack.packb(value)
    except (OverflowError, TypeError, ValueError):
        raise APIError(400, f"{param}: integers must fit in 64 bits", param) from None


def chat_tools(req: ChatRequest) -> tuple[list[FunctionSchema], ToolChoice]:
    """The request's functions (`tools` or legacy `functions`) and its tool choice (`tool_choice`
    or legacy `function_call`), validated: a 400 names the offending field. `required` and named
    choices are enforced by a grammar (api_server's ChatParsing.constrain)."""
    try:
        functions = parse_tools(req.tools, req.functions)
        if req.tool_choice is not None and req.function_call is not None:
            raise ToolSpecError("function_call", "give tool_choice or the legacy function_call")
        if req.function_call is not None:
            choice = resolve_tool_choice(req.function_call, functions, "function_call")
        else:
            choice = resolve_tool_choice(req.tool_choice, functions)
    except ToolSpecError as e:
        raise APIError(400, str(e), e.param) from None
    for f in functions:  # the schemas travel to a tokenizer worker in a message (msgpack)
        packable(f.parameters, "tools" if req.tools is not None else "functions")
    return functions, choice


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: OpenAI's developer role is the system's;
    an assistant's `tool_calls` and a tool result's `tool_call_id` and `name` pass through."""
    chat = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            known = ", ".join(CHAT_ROLES)
            message = f"messages[{i}].role: unknown role {m.role!r} (known: {known})"
            raise APIError(400, message, "messages")
        entry: dict[str, Any] = {"role": role, "content": chat_content(m, i)}
        extra = m.model_extra or {}
        for key in ("tool_call_id", "name"):
            if extra.get(key) is not None:
                if not isinstance(extra[key], str):
                    raise APIError(400, f"messages[{i}].{key} must be a string", "messages")
                entry[key] = extra[key]
        if extra.get("tool_calls"):
            if role != "assistant":
                message = f"messages[{i}].tool_calls: only assistant messages make tool calls"
                raise APIError(400, message, "messages")
            entry["tool_calls"] = history_tool_calls(extra["tool_calls"], f"messages[{i}]")
        chat.append(entry)
    return chat


def history_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, checked, with the arguments as an object: the
    templates of Qwen, Llama and Mistral render `arguments | tojson` (as transformers documents
    them), which would quote a JSON string again."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", "messages")
    result = []
    for j, call in enumerate(calls):
        param = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            message = f"{param}: must be {{'type': 'function', 'function': {{'name': ...}}}}"
            raise APIError(400, message, "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                message = f"{param}.function.arguments: not valid JSON"
                raise APIError(400, message, "messages") from None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{param}.function.arguments: must be an object", "messages")
        packable(arguments, "messages")
        entry = {**call, "type": "function", "function": {**function, "arguments": arguments}}
        result.append(entry)
    return result


def chat_content(m: ChatMessage, i: int) -> str:
    if not isinstance(m.content, list):
        return m.content or ""
    texts = []  # OpenAI content parts: the models served here read text only
    for part in m.content:
        if part.get("type") != "text":
            message = (
                f"messages[{i}].content: {part.get('type')!r} parts are not supported (text only)"
            )
            raise APIError(400, message, "messages")
        if not isinstance(part.get("text"), str):
            raise APIError(400, "messages: a text content part needs a string 'text'", "messages")
        texts.append(part["text"])
    return "".join(texts)
