"""Extension points: how the features outside the core attach to it.

The core (everything in `minisgl` but `minisgl.ext`) never imports an extension. Each package
under `minisgl/ext/` fills some of the points below when `minisgl.ext` is imported, and the core
finds them through `extensions()`, which imports `minisgl.ext` once and tolerates its absence:
without it every point keeps its do-nothing default, and a request or flag that asks for an
extension's feature is refused by `require`, naming the feature and the extension.
MINISGL_DISABLE_EXTENSIONS=1 runs the core alone with `minisgl/ext` present.

| point | called by | does | example |
|---|---|---|---|
| `routes` | `server.api_server.create_app` | adds HTTP routes to the app | `ext/serving/sglang.py: add_sglang_routes` (/flush_cache, /get_load...), `ext/serving/metrics.py: add_metrics_route` (/metrics) |
| `chat_features` | `ApiServer.chat_complete` / `.tokenize`, `server.protocol.chat_messages`, `ServerArgs`, `LLM.chat`, `shell.make_printers` | tool calls and reasoning: checks the parser flags, validates tools, constrains forced calls, splits each message / stream delta into content, reasoning_content and tool_calls | `ext/structured/features.py: StructuredChat` |
| `gguf_model` | `models.weight.resolve_model_path` | a `.gguf` file → a checkpoint directory (converted once, cached) | `ext/cpu/gguf.py: resolve_gguf` |
| `default_model` | `models.weight.default_model` (`LLM()`, `python -m minisgl` without `--model`) | the model file to use, announced | `ext/cpu/gguf.py: announce_default_model` (SmolLM2 GGUF) |
| `cpu_dtype` | `engine.engine._resolve_dtype` | what `--dtype auto` means on cpu | `ext/cpu/policy.py: auto_dtype` (bf16 for quantized weights) |
| `model_transform` | `Engine.__init__`, `Engine._build_model` | changes the model before / after its weights load | `ext/cpu/quantize.py: CpuModelTransform` (`--quantization`) |
| `decoder_transform` | `Engine.__init__` | the decoder of one-request decode steps | `ext/cpu/torch_compile.py` (`--enable-torch-compile`) |
| `generate_extras` | `ApiServer.generate` | checks /generate's undeclared fields (none: each is a 400) | `ext/serving/sglang.py: check_generate_extras` (SGLang's at their defaults) |
| `request_observer` | `Frontend.__init__` (its replies, aborts), `Gate` (its responses) | counts what the API process sees of its requests | `ext/serving/metrics.py: Metrics` (Prometheus, /metrics) |
| `dispatcher` | `tokenizer.server.run_tokenizer` (`--dp` > 1), `LLM.__init__` | which data-parallel replica each request goes to | `ext/serving/dispatch.py: Dispatcher` (`--dp-dispatch prefix`: longest indexed prefix) |
| `replicas` | `LLM.__init__` (`dp` > 1) | `LLM(dp=N)`'s N replica processes and their calls | `ext/serving/replicas.py: Replicas` |
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from minisgl import env

if TYPE_CHECKING:  # types only: torch is not imported to load the registry
    import torch

T = TypeVar("T")


class ExtensionMissing(ValueError):
    """A request or an option asks for a feature whose extension is not installed."""

    def __init__(self, what: str, extension: str) -> None:
        super().__init__(f"{what} needs the {extension} extension (minisgl/ext/{extension})")
        self.what, self.extension = what, extension


class ChatShaping(Protocol):
    """One chat request's responses as the structured extension shapes them (ChatFeatures)."""

    keep_special_tokens: bool  # the tool format's tags are special tokens: detokenize with them

    def constrain(self, params: Any) -> Any:
        """A choice's SamplingParams with the grammar its response must follow (forced calls)."""
        ...

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole response's message (content, reasoning_content, tool_calls), finish_reason."""
        ...

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """Choice `index`'s stream delta for its next text (the last: finish_reason set)."""
        ...


class ChatFeatures(Protocol):
    """Tool calling and reasoning (`minisgl/ext/structured`): what the core's chat paths ask of
    it. Request errors are the server's APIError (a 400 naming the field) or, offline, a
    ValueError; the types the core cannot name here (it would import itself) are `Any`."""

    def check_option(self, name: str, value: str) -> None:
        """OptionError unless `value` names a format of the option `name` (tool_call_parser or
        reasoning_parser)."""
        ...

    def template_tools(self, tools: Any) -> list[dict[str, Any]] | None:
        """A request's `tools`, validated, as the chat template takes them (/tokenize)."""
        ...

    def history_calls(self, calls: Any, where: str) -> list[dict[str, Any]]:
        """An assistant message's earlier `tool_calls` as the chat template takes them."""
        ...

    async def shape_chat(
        self, req: Any, chat: list[dict[str, Any]], api: Any
    ) -> tuple[list[dict[str, Any]] | None, ChatShaping | None]:
        """A ChatRequest's tools for the template, and the shaping of its responses (None: the
        text as it is); `api`: the ApiServer (its args, its tokenizer)."""
        ...

    def offline_chat(
        self, llm: Any, chats: list[list[dict[str, Any]]], params: list[Any], **options: Any
    ) -> list[dict[str, Any]]:
        """`LLM.chat` with tools or parsers (`options`: its keywords), results parsed."""
        ...

    def shell_printers(self, args: Any) -> Callable[[list[dict[str, str]]], Any]:
        """The shell's printer (a `shell.Printer`) of the answer to each history, for
        --reasoning-parser (ServerArgs `args`)."""
        ...


class ModelTransform(Protocol):
    """Changes a model around the loading of its weights (the cpu extension: `--quantization`
    makes projections int4 / int8 layers); the engine calls it in `Engine._build_model`."""

    name: str  # what it makes of the model, e.g. the quantization mode (`Engine.quantization`)

    def before_load(self, model: torch.nn.Module) -> set[str]:
        """Before the weights load: -> the parameter names that loading must skip."""
        ...

    def after_load(self, model: torch.nn.Module) -> None:
        """After the weights (or dummy weights) are in."""
        ...


class RequestObserver:
    """What an API process sees of its requests, counted (the serving extension's Prometheus
    metrics subclass it); this default counts nothing."""

    def reply(
        self, priority: int, submitted: float, last_token: float | None, reply: Any, now: float
    ) -> None:
        """One `UserReply` of a request submitted at `submitted` (monotonic seconds), whose
        previous token came at `last_token` (None: none yet)."""

    def ended(self, reason: str) -> None:
        """A request ended before its last reply (abort, timeout)."""

    def response(self, path: str, status: int) -> None:
        """The API process answered a request for `path` with `status`."""

    def text(self) -> str:
        """This process's counts for the process that answers for all of them ("": none)."""
        return ""


@dataclass
class Extensions:
    """Every point, with its do-nothing default."""

    # (app, api server, what the schedulers reported once ready) -> None: adds routes to the app
    routes: list[Callable[[Any, Any, dict[str, Any]], None]] = field(default_factory=list)
    # tool calls and reasoning in chat responses (None: refused, `require`)
    chat_features: ChatFeatures | None = None
    # (.gguf file) -> its checkpoint directory, converted once (None: a GGUF is refused)
    gguf_model: Callable[[str], str] | None = None
    # () -> the model file used when none is given, announced (None: --model is needed)
    default_model: Callable[[], str] | None = None
    # (--quantization, model dir) -> what --dtype auto means on cpu (None: float32)
    cpu_dtype: Callable[[str, str], torch.dtype] | None = None
    # (engine being built) -> the transform of its model around the weights' loading, or None
    model_transform: Callable[[Any], ModelTransform | None] | None = None
    # (engine, built) -> the decoder one-request decode steps run (--enable-torch-compile)
    decoder_transform: Callable[[Any], torch.nn.Module] | None = None
    # (a /generate body's undeclared fields) -> None or an APIError (None: every one is a 400)
    generate_extras: Callable[[dict[str, Any]], None] | None = None
    # (the API process's Frontend) -> the observer of its requests (None: nothing counted)
    request_observer: Callable[[Any], RequestObserver] | None = None
    # (replicas, page size, --dp-dispatch, --dp-load-threshold) -> the object that picks each
    # request's replica (`choose`, `sent`, `replica_of`, `done`); None: --dp > 1 is refused
    dispatcher: Callable[..., Any] | None = None
    # (LLM class, model dir, tp, dp, options, dispatcher) -> `LLM(dp=N)`'s replica processes
    # (`generate`, `call_all`, `shutdown`, `procs`); None: dp > 1 is refused
    replicas: Callable[..., Any] | None = None
    # -- points --
    loaded: bool = False


_EXTENSIONS = Extensions()


def extensions() -> Extensions:
    """The registry, with `minisgl.ext` imported (once) if it is there."""
    if not _EXTENSIONS.loaded and not env.disable_extensions():
        _EXTENSIONS.loaded = True
        try:
            importlib.import_module("minisgl.ext")
        except ModuleNotFoundError as e:
            if e.name != "minisgl.ext":  # an extension that is there but broken: say so
                raise
    return _EXTENSIONS


def require(value: T | None, what: str, extension: str) -> T:
    """`value` (an extension's part), or the error saying that `what` needs `extension`."""
    if value is None:
        raise ExtensionMissing(what, extension)
    return value
