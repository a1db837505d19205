"""The HTTP request bodies (OpenAI's and the native), their checks and `SamplingParams`, and
OpenAI's error shape. Extensions' fields stay a body's extras for their `ExtensionFields`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeVar

import msgpack
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse  # fastapi's is it; fastapi's package is heavy

from minisgl.core import EXTENSION_PARAMS, SamplingParams
from minisgl.extension import ExtensionMissing, extensions

MAX_CHOICES = 1024  # prompts x n of one completion request (n alone: at most 64)


@dataclass(eq=False)
class APIError(Exception):
    """An HTTP error, answered as OpenAI's error body (`error_body`)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message


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


class Body(BaseModel):
    """A request body or part of one: strict JSON types (no true for 1, no "0.5"), finite."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


B = TypeVar("B", bound=Body)


def parse(model: type[B], data: dict[str, Any], where: str | None = None) -> B:
    """`data` as `model`, or a 400 naming the field (`where`: the object that holds it)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        named = loc if where is None else f"{where}.{loc}"
        raise APIError(400, f"{named}: {err['msg']}", where or loc) from None


class ChoiceShaper(Protocol):
    """What an extension adds to the choices of one response (e.g. their `logprobs`)."""

    def add(self, index: int, reply: Any) -> None:
        """Choice `index`'s next reply (a UserReply); it may change the reply's `text_delta`
        (the echo: the prompt before the first)."""

    def fields(self, index: int) -> dict[str, Any]:
        """Choice `index`'s fields for the replies added since the last call."""


class ExtensionFields(Body):
    """Request fields an extension implements (the `request_fields` point), validated here."""

    def params(self, req: Any) -> dict[str, Any]:
        """The SamplingParams keywords they set (`req`: the whole request)."""
        return {}

    async def shaper(self, chat: bool, msgs: list[Any], api: Any) -> ChoiceShaper | None:
        """What they add to each choice (`msgs`: TokenizeMsgs; `api`: the ApiServer), or None."""
        return None

    def allows_no_tokens(self) -> bool:
        """max_tokens 0 is allowed (the echo: the prompt alone is the answer)."""
        return False

    def apply(self, msgs: list[Any], args: Any) -> None:
        """Set what they set on the request's TokenizeMsgs beyond their SamplingParams."""


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


# Larger integers cannot travel in a message (msgpack) nor live in a tensor: refuse them here.
# (A Body is strict: a boolean or a string is no integer.)
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class SamplingFields(Body):
    # undeclared fields are kept (model_extra): the extensions' (`request_extensions`), or
    # refused / warned about (`check_extras`)
    model_config = ConfigDict(extra="allow")
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


class CompletionRequest(SamplingFields):
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    max_tokens: Int64 | None = 16


class ChatMessage(Body):
    model_config = ConfigDict(extra="allow")  # an assistant's `tool_calls`: ext/structured's
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None


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


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**63)] | None = None
    chat_template_kwargs: TemplateKwargs = None


class GenerateRequest(Body):
    # SGLang's other fields (sglang-router passes them on) are kept to be checked (`check_extras`)
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input_ids: list[Int64] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False


# the body fields that the extensions implement -> (extension, the value that asks for
# nothing): without the extension any other value is a 400 naming it
EXTENSION_FIELDS: dict[str, tuple[str, Any]] = {
    **{name: off for name, off in EXTENSION_PARAMS.items() if name != "prompt_logprobs"},
    "top_logprobs": ("sampling", None),
    "echo": ("sampling", False),
    "response_format": ("structured", {"type": "text"}),
    **dict.fromkeys(
        ("tools", "functions", "tool_choice", "function_call", "parallel_tool_calls"),
        ("structured", None),
    ),
    "data_parallel_rank": ("serving", None),
    "lora_path": ("lora", None),
}


def request_extensions(
    req: SamplingFields, path: str, where: str | None = None
) -> list[ExtensionFields]:
    """The extensions' models for `path` made of the request's extras; the rest `check_extras`."""
    extra, taken = dict(req.model_extra or {}), list[ExtensionFields]()
    for model in extensions().request_fields.get(path, []):
        given = {name: extra.pop(name) for name in list(extra) if name in model.model_fields}
        taken.append(parse(model, given))
    check_extras(extra, where or path)
    return taken


def check_extras(extra: dict[str, Any], path: str) -> None:
    """Extras no extension took: a missing extension's field is refused naming it; the others
    go to the `unknown_fields` point (ext/serving), else each is a 400."""
    points = extensions()
    declared = {
        f for models in points.request_fields.values() for m in models for f in m.model_fields
    }
    for name, value in extra.items():
        if name in EXTENSION_FIELDS and name not in declared:
            extension, off = EXTENSION_FIELDS[name]
            if value is not None and value != off:
                raise APIError(400, str(ExtensionMissing(name, extension)), name)
    unknown = {name: value for name, value in extra.items() if name not in EXTENSION_FIELDS}
    if points.unknown_fields is not None:
        points.unknown_fields(path, unknown)
    elif unknown:
        name = next(iter(unknown))
        raise APIError(400, f"{name}: unknown field of {path}", name, "unknown_field")


# the SamplingFields that are SamplingParams fields as they are
BASE_PARAMS = {"temperature", "top_k", "top_p", "min_p", "ignore_eos", "seed"}


def sampling_params(
    req: SamplingFields, max_tokens: int, taken: list[ExtensionFields]
) -> SamplingParams:
    """The request's SamplingParams (its base fields, and those its extensions' fields set)."""
    if max_tokens < 0 or (max_tokens == 0 and not any(f.allows_no_tokens() for f in taken)):
        message = f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}"
        raise APIError(400, message, "max_tokens")
    extra = {key: value for fields in taken for key, value in fields.params(req).items()}
    try:
        return SamplingParams(
            **req.model_dump(include=BASE_PARAMS),
            max_tokens=max_tokens,
            stop_token_ids=req.stop_token_ids or [],
            stop=req.stop or [],
            **extra,
        )
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0]) from None


def native_fields(req: GenerateRequest) -> tuple[SamplingFields, int]:
    """/generate's sampling_params (native names and defaults; SGLang's top-level priority,
    lora_path and data_parallel_rank too) as one choice's fields, and its max_tokens."""
    if (req.input_ids is None) == (req.text is None):
        raise APIError(400, "give exactly one of input_ids and text", "input_ids")
    params = {"temperature": 0.0, "max_tokens": 128, **req.sampling_params}
    for name in ("priority", "lora_path", "lora_name", "data_parallel_rank"):  # SGLang's places
        if name in (req.model_extra or {}):
            params[name] = req.model_extra.pop(name)  # type: ignore[union-attr]
    if "max_new_tokens" in params:  # the native name
        params["max_tokens"] = params.pop("max_new_tokens")
    if type(params["max_tokens"]) is not int:
        name = "max_new_tokens" if "max_new_tokens" in req.sampling_params else "max_tokens"
        raise APIError(400, f"sampling_params.{name} must be an integer", "sampling_params")
    fields = parse(SamplingFields, params, "sampling_params")
    fields.n = 1
    return fields, fields.max_tokens  # type: ignore[return-value]


def completion_sources(req: CompletionRequest) -> list[dict[str, Any]]:
    """A completion request's prompts (one, or a batch) as TokenizeMsg fields, one per prompt."""
    prompts: list[Any] = [req.prompt]
    if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
        prompts = list(req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        message = f"give 1 to {MAX_CHOICES // req.n} prompts (n={req.n}), got {len(prompts)}"
        raise APIError(400, message, "prompt")
    return [
        {"text": None, "input_ids": list(p), "chat": None}
        if isinstance(p, list)
        else {"text": p, "input_ids": None, "chat": None}
        for p in prompts
    ]


def chat_max_tokens(req: ChatRequest) -> int | None:
    """max_completion_tokens (OpenAI's newer name) or max_tokens; both only when they agree."""
    new, old = req.max_completion_tokens, req.max_tokens
    if new is not None and old is not None and new != old:
        message = f"max_completion_tokens ({new}) and max_tokens ({old}) differ: give one"
        raise APIError(400, message, "max_completion_tokens")
    return new if new is not None else old


# the chat template's role of each request role (OpenAI's newer `developer` is the system's)
CHAT_ROLES = {r: r for r in ("system", "user", "assistant", "tool")} | {"developer": "system"}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (earlier `tool_calls`: ext/structured's)."""
    chat = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if (role := CHAT_ROLES.get(m.role)) is None:
            message = f"{where}.role: unknown role {m.role!r} (known: {', '.join(CHAT_ROLES)})"
            raise APIError(400, message, "messages")
        entry: dict[str, Any] = {"role": role, "content": chat_content(m, where)}
        entry |= m.model_dump(include={"tool_call_id", "name"}, exclude_none=True)
        if calls := (m.model_extra or {}).get("tool_calls"):
            if role != "assistant":
                message = f"{where}.tool_calls: only assistant messages make tool calls"
                raise APIError(400, message, "messages")
            if (features := extensions().chat_features) is None:
                missing = ExtensionMissing(f"{where}.tool_calls", "structured")
                raise APIError(400, str(missing), "messages")
            entry["tool_calls"] = features.history_calls(calls, where)
        chat.append(entry)
    return chat


def chat_content(m: ChatMessage, where: str) -> str:
    if not isinstance(m.content, list):
        return m.content or ""
    for part in m.content:  # OpenAI content parts: the models served here read text only
        if part.get("type") != "text":
            message = f"{where}.content: {part.get('type')!r} parts are not supported (text only)"
            raise APIError(400, message, "messages")
        if not isinstance(part.get("text"), str):
            raise APIError(400, "messages: a text content part needs a string 'text'", "messages")
    return "".join(part["text"] for part in m.content)


# the request fields an error found past the API server may name (the message's first word)
REFUSABLE_FIELDS = frozenset(
    {"prompt", "messages", "input_ids", "text", *SamplingFields.model_fields, *EXTENSION_FIELDS}
)


def refused_field(message: str) -> str | None:
    """The field a worker's refusal names by starting with it ("stop_token_ids: ..."), or None."""
    first = message.split(" ", 1)[0]
    return first[:-1] if first.endswith(":") and first[:-1] in REFUSABLE_FIELDS else None
