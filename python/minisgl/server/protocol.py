"""The HTTP API's request bodies (pydantic models of the OpenAI and native requests), their
checks, and their translation into `SamplingParams`; errors in OpenAI's JSON shape."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgpack
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

from minisgl.core import CONSTRAINT_KINDS, MAX_LOGPROBS, SamplingParams
from minisgl.extension import ChatFeatures, ExtensionMissing, extensions, require

logger = logging.getLogger(__name__)
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


class Body(BaseModel):
    """A request body, or a part of one: JSON types are taken as they are, as OpenAI does (no
    "yes" for true, no true for 1, no "0.5" for a number)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


# Larger integers cannot travel in a message (msgpack) nor live in a tensor: refuse them here.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
# a token id: a JSON integer, never a boolean (lax ints take `false` for 0) nor a string
TokenId = Annotated[int, Strict(), Field(ge=-(2**63), lt=2**63)]


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


class SamplingFields(Body):
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
    priority: Int64 = 0  # the serving extension's --schedule-policy priority: lower first (vLLM's)


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


class ChatMessage(Body):
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
    # tool calling: the structured extension's (ChatFeatures.shape_chat), refused without it
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


class TokenizeRequest(Body):
    """vLLM's /tokenize: a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    tools: Any = None  # rendered as in a chat request
    # vLLM's: unset, as the server encodes a completion's prompt (the tokenizer's BOS...) or a
    # chat (none: the template writes them)
    add_special_tokens: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]


class GenerateRequest(Body):
    # SGLang's other fields (sglang-router passes them on) are kept to be checked:
    # `api_server.check_extras` (the generate_extras point)
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
    if given and "json_schema" not in extensions().sampling_params:  # named as the client did
        name = next(iter(given))
        raise APIError(400, str(ExtensionMissing(name, "structured")), name)
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


# the fields of a chat request that ask for tool calling
TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call")


def chat_features(what: str, param: str) -> ChatFeatures:
    """The structured extension's tool calling and reasoning, or a 400 naming `param`: `what`
    needs the extension."""
    try:
        return require(extensions().chat_features, what, "structured")
    except ExtensionMissing as e:
        raise APIError(400, str(e), param) from None


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: OpenAI's developer role is the system's;
    a tool result's `tool_call_id` and `name` pass through, an assistant's earlier `tool_calls`
    as the structured extension shapes them."""
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
            features = chat_features(f"messages[{i}].tool_calls", "messages")
            entry["tool_calls"] = features.history_calls(extra["tool_calls"], f"messages[{i}]")
        chat.append(entry)
    return chat


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


# the request fields an error found past the API server may name (the message's first word)
REFUSABLE_FIELDS = frozenset(
    {"prompt", "messages", "input_ids", "text", "tokens", *SamplingFields.model_fields}
)


def refused_field(message: str) -> str | None:
    """The field a refusal from a worker names, by the convention that its message starts with
    it ("stop_token_ids: token id 9 is not ..."), or None."""
    first = message.split(" ", 1)[0]
    return first[:-1] if first.endswith(":") and first[:-1] in REFUSABLE_FIELDS else None


class UnknownFields:
    """Warns about request fields this server ignores, once per name and then at 10, 100, ...
    uses (a client may send thousands of distinct names: at most MAX_NAMES are remembered,
    the rest counted together), so that no request can fill the log."""

    MAX_NAMES = 256
    SHOWN = 5  # names shown in one warning

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.others = 0  # uses of names beyond MAX_NAMES

    def seen(self, path: str, names: list[str]) -> None:
        new, again = [], []
        for name in names:
            if name not in self.counts and len(self.counts) >= self.MAX_NAMES:
                self.others += 1
                if _power_of_ten(self.others):
                    again.append(f"{self.others} of other names")
                continue
            count = self.counts[name] = self.counts.get(name, 0) + 1
            if count == 1:
                new.append(name)
            elif _power_of_ten(count):
                again.append(f"{_shown(name)} {count} times")
        if new:
            shown = ", ".join(map(_shown, new[: self.SHOWN]))
            more = f" and {len(new) - self.SHOWN} more" if len(new) > self.SHOWN else ""
            logger.warning("%s: ignoring unknown fields %s%s", path, shown, more)
        if again:
            logger.warning("%s: unknown fields ignored so far: %s", path, ", ".join(again))


def _power_of_ten(n: int) -> bool:
    return n >= 10 and str(n).rstrip("0") == "1"


def _shown(name: str) -> str:
    return repr(name if len(name) <= 64 else name[:61] + "...")
