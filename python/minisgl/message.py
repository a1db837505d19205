"""The messages between the server's processes (api server -> tokenizer -> scheduler ->
detokenizer -> api server), dataclasses that `encode` / `decode` carry through msgpack."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from minisgl.core import SamplingParams

T = TypeVar("T")


# ---- api server -> tokenizer worker ----
@dataclass
class TokenizeMsg:
    """A new request: exactly one of `text`, `input_ids` or `chat` (OpenAI messages)."""

    uid: int
    text: str | None
    input_ids: list[int] | None
    chat: list[dict] | None
    params: SamplingParams
    skip_special_tokens: bool = True
    chat_template_kwargs: dict | None = None  # extra arguments of apply_chat_template
    tools: list[dict] | None = None  # OpenAI `tools` entries the chat template renders
    # the model's context when the client gave max_tokens: a longer prompt + max_tokens is refused
    context_len: int | None = None
    # the longest prompt + output (tokens): a text too long for it is refused before tokenizing
    max_seq_len: int | None = None
    dp_rank: int | None = None  # the --dp replica it must run on (None: the dispatcher's choice)

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.text, self.input_ids, self.chat)) != 1:
            raise ValueError("exactly one of text, input_ids and chat must be given")


@dataclass
class AbortMsg:
    """The client went away (or cancelled): drop request `uid` everywhere."""

    uid: int


# ---- tokenizer worker / detokenizer / api server -> scheduler (rank 0) -> ranks > 0 ----
@dataclass
class UserMsg:
    """A tokenized request, ready to schedule."""

    uid: int
    input_ids: list[int]
    params: SamplingParams


@dataclass
class AbortBackendMsg:
    """Stop generating for `uid` and free its cache (client gone, or a stop string was hit)."""

    uid: int


@dataclass
class FlushCacheMsg:
    """Rank 0 -> ranks > 0: empty the prefix cache (no request runs: `Scheduler.flush_cache`)."""


@dataclass
class ExitMsg:
    """Shut the receiving loop down."""


# ---- scheduler -> detokenizer ----
@dataclass
class DetokenizeMsg:
    """The tokens generated for `uid` since its previous message (a scheduler step's output:
    one at most; `LLM` reads them in its process)."""

    uid: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
    error: str | None = None  # why the scheduler refused the request
    queue_time: float | None = None  # with the first token: seconds queued before its prefill
    cached_tokens: int | None = None  # with the first token: prompt tokens from the prefix cache
    # the step features' values for it (`StepFeature.output`: ext/sampling's log-probabilities)
    ext: dict[str, Any] = field(default_factory=dict)


@dataclass
class DetokInitMsg:
    """Tokenizer -> detokenizer, before the scheduler: how to turn the request's tokens to text."""

    uid: int
    prompt_len: int
    prompt_tail: list[int]  # the last prompt tokens, context for the first decoded word
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings cannot end the output before this many tokens
    dp_rank: int = 0  # the replica the request went to (where a stop string's abort goes)


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler (rank 0), passed through to the api server."""

    running: int = 0
    waiting: int = 0
    total_pages: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    locked_pages: int = 0
    leaked_pages: int = 0  # owned by neither the allocator, the cache nor a request: a bug
    num_preemptions: int = 0
    prefill_tokens: int = 0  # prompt tokens scheduled so far (re-prefills after preemption too)
    cached_tokens: int = 0  # of those, found in the prefix cache
    counts: dict[str, int] = field(default_factory=dict)  # the extensions' (speculation's)
    dp_rank: int = 0  # the replica (--dp) this snapshot is of


# ---- detokenizer / tokenizer worker -> api server ----
@dataclass
class UserReply:
    """Request `uid`'s text finalized since its previous reply, and the tokens that made it."""

    uid: int
    text_delta: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    completion_tokens: int  # total so far, not just this delta
    error: str | None = None
    queue_time: float | None = None  # once: seconds in the scheduler's queue
    matched: str | None = None  # the stop string that ended it (finish_reason "stop")
    cached_tokens: int | None = None  # once: prompt tokens the prefix cache supplied
    # what the extensions add (`DetokenizeFeatures.name_logprobs`: the log-probabilities)
    ext: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchMsg:
    """Several messages in one send: the backend's (rank 0 -> ranks > 0), or one scheduler
    step's DetokenizeMsgs (-> detokenizer) or UserReplies (-> api server) with its stats."""

    msgs: list = field(default_factory=list)
    stats: SchedulerStats | None = None


# ---- (de)serialisation ----
# A dataclass travels as a msgpack array [its class tag, *field values], values packed in place
# (SamplingParams inside UserMsg); the tag is an extension value holding the class name, which
# decoding turns into the class, and the array whose first item is a class into its instance.
# Every dataclass above is registered. (Inline arrays, not one packed blob a message: a step's
# BatchMsg of 200 replies encodes in 155 us instead of 503, decodes in 139 instead of 163.)
_EXT_CLASS = 1
_TYPES: dict[str, type] = {}
_LAYOUTS: dict[type, tuple[msgpack.ExtType, tuple[str, ...]]] = {}  # class -> tag, field names


def register(cls: type[T]) -> type[T]:
    """Make the dataclass `cls` encodable, by its class name."""
    if not dataclasses.is_dataclass(cls):  # decoding rebuilds it with cls(*field values)
        raise TypeError(f"{cls.__name__} must be a dataclass")
    if _TYPES.setdefault(cls.__name__, cls) is not cls:
        raise ValueError(f"message type name {cls.__name__!r} is already registered")
    names = tuple(f.name for f in dataclasses.fields(cls))
    _LAYOUTS[cls] = (msgpack.ExtType(_EXT_CLASS, cls.__name__.encode()), names)
    return cls


def _default(obj: Any) -> list:
    if (layout := _LAYOUTS.get(type(obj))) is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message type")
    return [layout[0], *[getattr(obj, name) for name in layout[1]]]


def _ext_hook(code: int, data: bytes) -> type:
    if code != _EXT_CLASS or (cls := _TYPES.get(data.decode())) is None:
        raise ValueError(f"unknown message type {data!r} (extension {code})")
    return cls


def _list_hook(items: list) -> Any:
    # an array whose first item is a class (only a tag decodes to one): that class's instance
    return items[0](*items[1:]) if items and isinstance(items[0], type) else items


def encode(msg: Any) -> bytes:
    """A message (or any msgpack value holding messages) as bytes; tuples come back as lists."""
    return msgpack.packb(msg, default=_default)


def decode(data: bytes) -> Any:
    """`encode`'s inverse; ValueError for any payload it did not make (the receiver drops it)."""
    try:  # strict_map_key=False: dicts with int keys are allowed (token id -> logprob maps)
        return msgpack.unpackb(
            data, ext_hook=_ext_hook, list_hook=_list_hook, raw=False, strict_map_key=False
        )
    except Exception as e:  # msgpack's ValueErrors, cls(*values)'s TypeError, RecursionError
        raise ValueError(f"malformed message: {type(e).__name__}: {e}") from e


for _cls in list(globals().values()):
    if isinstance(_cls, type) and dataclasses.is_dataclass(_cls):
        register(_cls)  # every message above, and SamplingParams
