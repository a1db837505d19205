"""Extension points: how the features outside the core attach to it.

The core (everything in `minisgl` but `minisgl.ext`) never imports an extension. Each package
under `minisgl/ext/` fills some points of `Extensions` when `minisgl.ext` is imported; the core
finds them through `extensions()`, which tolerates its absence: every point then keeps its
do-nothing default, and a request or flag that needs an extension is refused by `require`.
MINISGL_DISABLE_EXTENSIONS=1 runs the core alone with `minisgl/ext` present. docs/structure.md
lists the points (who calls each, an example) and the hooks of the classes below.
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
Shaped = tuple[dict[str, Any], str | None]  # (a message or delta, its finish_reason)


class ExtensionMissing(ValueError):
    """A request or an option asks for a feature whose extension is not installed."""

    def __init__(self, what: str, extension: str) -> None:
        super().__init__(f"{what} needs the {extension} extension (minisgl/ext/{extension})")
        self.what, self.extension = what, extension


class ChatShaping(Protocol):
    """One chat request's responses as the structured extension shapes them."""

    keep_special_tokens: bool  # the tool format's tags are special tokens: detokenize with them

    def constrain(self, params: Any) -> Any: ...  # SamplingParams with a forced call's grammar

    # (message: content, reasoning_content, tool_calls; finish_reason) of a whole response
    def message(self, text: str, finish_reason: str | None) -> Shaped: ...

    # the stream delta of choice `index` for its next text (the last has finish_reason set)
    def delta(self, index: int, text: str, finish_reason: str | None) -> Shaped: ...


class ChatFeatures(Protocol):
    """Tool calling and reasoning (ext/structured) as the core's chat paths use them. Request
    errors are APIError (a 400 naming the field) or, offline, ValueError."""

    # at start: the parsers `auto` picks from the model's chat template; `none` -> None
    def resolve_parsers(self, args: Any, model_path: str) -> None: ...

    # a request's `tools`, validated, as the chat template takes them (/tokenize)
    def template_tools(self, tools: Any) -> list[dict[str, Any]] | None: ...

    # an assistant message's earlier `tool_calls` as the chat template takes them
    def history_calls(self, calls: Any, where: str) -> list[dict[str, Any]]: ...

    # a ChatRequest's tools for the template and its responses' shaping (None: text as is)
    async def shape_chat(
        self, req: Any, chat: list[dict[str, Any]], api: Any
    ) -> tuple[list[dict[str, Any]] | None, ChatShaping | None]: ...

    # `LLM.chat` with tools or parsers (`options`: its keywords), results parsed
    def offline_chat(
        self, llm: Any, chats: list[list[dict[str, Any]]], params: list[Any], **options: Any
    ) -> list[dict[str, Any]]: ...

    # the shell's printer of the answer to each history (--reasoning-parser; None: the core's)
    def shell_printers(self, args: Any) -> Callable[[list[dict[str, str]]], Any] | None: ...


class DetokenizeFeatures(Protocol):
    """The detokenizer's work for ext/sampling (the detokenizer process's and `LLM`'s)."""

    # a request's IncrementalDetokenizer whose stop strings count only past min_tokens > 0
    def detokenizer(
        self, tokenizer: Any, prompt_ids: list[int], skip: bool, stop: list[str], min_tokens: int
    ) -> Any: ...

    # a DetokenizeMsg's log-probabilities into its UserReply, each token named by its text
    def name_logprobs(self, tokenizer: Any, msg: Any, reply: Any) -> None: ...


class ModelTransform(Protocol):
    """Changes a model around the loading of its weights (`Engine._build_model`)."""

    name: str  # what it makes of the model, e.g. the quantization mode (`Engine.quantization`)

    def before_load(self, model: torch.nn.Module) -> set[str]: ...  # -> parameters not loaded

    def after_load(self, model: torch.nn.Module) -> None: ...


class Observation(Protocol):
    """What a `StepFeature` reads of a step's raw outputs, on its way to the host."""

    # the step's sampled ids [B] are queued: compute what needs them, queue the host copies
    def finish(self, next_ids: torch.Tensor) -> None: ...


class StepFeature:
    """A feature of the scheduler's steps (logprobs, logit adjustments, grammars), one per
    Scheduler. A request it acts on holds its state in `req.ext[name]` (set by `request`);
    the hooks marked "its" see only those, and a step with no `ext` calls none. Every hook
    does nothing by default; docs/structure.md says when each is called."""

    name = ""  # its key in Req.ext and in a step's results
    stage = 0  # processors run in stage order: a mask (0) before the adjustments (1) it bounds
    scores_prompt = False  # max_tokens=0 still runs its requests' prefill (prompt logprobs)
    changes_logits = False  # `process` may change its requests' logits (sampled eagerly after)
    needs_tokens = False  # `prepare` reads the tokens of the step in flight (no overlap then)

    # ---- requests (Scheduler) ----
    def request(self, req: Any) -> None:
        """Check the request (ValueError); set req.ext[name] if the feature acts on it."""

    def holds(self, req: Any) -> bool:
        """Its, added: True keeps it out of the queue until the feature queues or ends it."""
        return False

    def before_step(self) -> None:
        """Each step's start, before it is planned (ext/held.py: admit the requests it held)."""

    def settle(self, req: Any) -> None:
        """Offline, its: wait for what holds the request; raise its error (ValueError)."""

    def prefix_limit(self, req: Any) -> int:
        """Its: how many leading tokens the prefix cache may supply at most."""
        return len(req.tokens)

    def cache_namespace(self, req: Any) -> int:
        """Its: the prefix cache's namespace of its KV, < 2**31 (0: shared with all; LoRA)."""
        return 0

    def admitted(self, req: Any) -> None:
        """Every request given a page-table row: the row's previous state is the feature's."""

    def finished(self, req: Any) -> None:
        """Its end (once; before the core releases it)."""

    def shutdown(self) -> None:
        """The scheduler stops."""

    # ---- a step's logits (Engine) ----
    def prepare(self, batch: Any, samples: list[bool]) -> Any:
        """Host input of `process`, built while the forward runs (None: nothing to do)."""
        return None

    def observe(self, engine: Any, batch: Any, out: Any) -> Observation | None:
        """The step's ForwardOutput before any processor: its raw logits [B, V] and, in an
        eager prefill, every token's hidden states (None: nothing to observe)."""
        return None

    def process(self, engine: Any, batch: Any, out: Any, prepared: Any, masked: bool) -> bool:
        """Change `out.logits` in place before sampling; True when it masked logits."""
        return False

    # ---- a step's outputs (Scheduler, on the host) ----
    def read(self, reqs: list[Any], result: Any) -> list[Any] | None:
        """The step's `observe` result on the host: a value per batch row, or None."""
        return None

    def output(self, req: Any, value: Any, output: Any) -> None:
        """Its row's `read` value into the request's output (a DetokenizeMsg's `ext`)."""

    def accept(self, req: Any, token: int, reason: str | None) -> tuple[str | None, str | None]:
        """Its token, with the core's finish reason: (finish reason, error)."""
        return reason, None

    def result(self, req: Any, outputs: list[Any]) -> dict[str, Any]:
        """Offline (`LLM.generate`), its: what its result adds, from its outputs."""
        return {}


class Speculator(StepFeature):
    """Speculative decoding (ext/spec), a step feature of every running request: they propose
    tokens past their last, the step computes them as an extend, its forward path samples the
    target at each position, the scheduler outputs the run the target agrees with (`accept_run`)."""

    # its key in a step's results: the target's tokens, which `read` gives to each batch row
    # that verifies (None: the others)
    name = "spec"

    def propose(self, planner: Any, decodes: list[Any]) -> None:
        """Once per decode step planned, its decode rows (each with the pages of its next token):
        proposals past some, each where pages are left (`planner.grow`; extend_len 1 + them)."""

    def accept_run(self, engine: Any, req: Any, slot: int, targets: list[int]) -> list[int]:
        """The run the scheduler outputs (the proposals up to the first the target rejects,
        then the target's token): the rest's KV dropped, req.tokens cut to `slot`."""
        return targets[:1]

    def result(self, req: Any, outputs: list[Any] | None = None) -> dict[str, Any]:
        """Its counts in the request's offline result (`LLM.generate`)."""
        return {}

    def counts(self) -> dict[str, int]:
        """Running totals for the server's stats (`SchedulerStats.counts`)."""
        return {}

    def release(self, req: Any) -> None:
        """The request leaves the running set (ends, or is preempted)."""


class ForwardPath:
    """A speed path of the engine's forward (`forward_paths`): a batch the decode graphs
    cannot replay as it is, run another way (e.g. one graph row per position; its
    ForwardOutput then keeps those `rows` and a `regroup` of their ids)."""

    def forward(self, engine: Any, batch: Any, samples: list[bool], resample: bool) -> Any:
        """The batch's queued ForwardOutput, or None: the next path, else the eager step."""
        return None

    def prefill_budget(
        self, planner: Any, budget: int, decodes: list[Any], num_decode_tokens: int
    ) -> int:
        """The prompt tokens the planner may schedule beside `decodes` (at most `budget`)."""
        return budget


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
    # the short id the server gives default_model's model (/v1/models; None: its path)
    default_model_name: str | None = None
    # (engine being built) -> the transform of its model around the weights' loading, or None
    model_transform: Callable[[Any], ModelTransform | None] | None = None
    # (engine, built) -> the decoder one-request decode steps run (--enable-torch-compile), or None;
    # before the Context is made of them it may swap the engine's modules and attention backend
    # for their speed paths (ext/cpu's on cpu)
    decoder_transform: Callable[[Any], torch.nn.Module | None] | None = None
    # (path, a body's fields that no one declares) -> None or an APIError (None: each is a 400)
    unknown_fields: Callable[[str, dict[str, Any]], None] | None = None
    # HTTP path -> the models (`server.protocol.ExtensionFields`) of the body fields there that
    # extensions implement: each made of the fields of a request it declares
    request_fields: dict[str, list[Any]] = field(default_factory=dict)
    # (an HTTP request's first TokenizeMsg) -> None or an APIError: bounds on its work
    request_checks: list[Callable[[Any], None]] = field(default_factory=list)
    # () -> the `LLM` subclass that `LLM(dp=N, dp_dispatch=..., dp_load_threshold=...)` makes
    # (replica processes); None: those options are refused
    replicas: Callable[[], type] | None = None
    # extension name -> the dataclass of its flags (`option(...)` fields; an optional
    # `check(args)` cross-checks them against the ServerArgs): --help lists them under the
    # extension, `ServerArgs.extras[name]` holds them parsed (without it: unknown flags)
    options: dict[str, type] = field(default_factory=dict)
    # (app, args, frontend, paths) -> the ASGI middleware every HTTP request passes: a
    # `server.gate.Gate` subclass (None: the Gate, which checks nothing)
    gate: Callable[..., Any] | None = None
    # (args, app, frontend) -> the uvicorn server an API process runs `app` with (None: plain
    # uvicorn, in `server.launch.http_server`)
    http_server: Callable[..., Any] | None = None
    # an extension's SamplingParams parameter (kept in `SamplingParams.ext`) -> its check
    # (normalizes `ext` in place, ValueError); one set without it is refused (EXTENSION_PARAMS)
    sampling_params: dict[str, Callable[[Any], None]] = field(default_factory=dict)
    # (scheduler) -> a feature of its steps, or None when it has nothing to do there (a
    # `Speculator` among them: its speculative decoding; none: the core proposes nothing)
    step_features: list[Callable[[Any], StepFeature | None]] = field(default_factory=list)
    # (path) -> the JSON body of an error answered there, (status, message, param, code) ->
    # body: the Gate's refusals on the paths of an API whose clients expect another shape than
    # OpenAI's (none: OpenAI's `error_body`)
    error_bodies: dict[str, Callable[[int, str, str | None, str | None], dict[str, Any]]] = field(
        default_factory=dict
    )
    # (args) -> the launcher of the server's processes, a `server.launch.Launcher` subclass
    # (None: the Launcher: one API process, one machine)
    launcher: Callable[..., Any] | None = None
    # --schedule-policy name -> (SchedulerConfig, KVCacheManager) -> the planner's waiting
    # queue, a `scheduler.queue.WaitingQueue` subclass: which request goes next, and which
    # running one gives way to it (none: only the core's fcfs)
    admission_policies: dict[str, Callable[[Any, Any], Any]] = field(default_factory=dict)
    # extension name -> the dataclass of its options that configure the schedulers (and, through
    # `engine_config`, their engines): as `options`, parsed into `SchedulerConfig.extras[name]`,
    # and keywords of `LLM(...)`
    scheduler_options: dict[str, type] = field(default_factory=dict)
    # (engine config, scheduler config) -> the EngineConfig a scheduler builds its engine with
    # (e.g. with an extension's options in `EngineConfig.extras`)
    engine_config: list[Callable[[Any, Any], Any]] = field(default_factory=list)
    # (engine, scheduler config) -> the SchedulerConfig a scheduler plans with: its defaults
    # for the engine (ext/perf: larger step budgets where a small model's steps are host-bound)
    scheduler_config: list[Callable[[Any, Any], Any]] = field(default_factory=list)
    # (scheduler) -> a speed path of its engine's forward and planner, or None (off)
    forward_paths: list[Callable[[Any], ForwardPath | None]] = field(default_factory=list)
    # (LLM, lora_request: one or one per prompt, params per prompt) -> the params naming each
    # prompt's adapter (vLLM's LoRARequest; one not served yet is read now); None: refused
    lora_request: Callable[[Any, Any, Any], list[Any]] | None = None
    # min_tokens' stop strings and the log-probabilities' token texts in the detokenizer
    # (None: min_tokens is refused)
    detokenize: DetokenizeFeatures | None = None
    # (prefill backend, decode backend) -> the attention backend of `--attn PREFILL,DECODE`
    # (None: a pair of two backends is refused)
    hybrid_attention: Callable[[Any, Any], Any] | None = None
    # (device, KV cache dtype) -> the prefill backend `--attn auto` pairs with Triton's decode
    # (ext/perf's: fi on Hopper; None: Triton's own)
    auto_prefill: Callable[[Any, Any], str] | None = None
    # (scheduler) -> None: synthetic requests served at the server's start, where kernels
    # compile at first use, so that they compile before the first user's request (None: they
    # compile in the first requests; --skip-server-warmup: not called)
    warm_up: Callable[[Any], None] | None = None
    # (page table, token table) -> the engine's writer of them, an `engine.tables.TableWrites`
    # subclass (ext/perf: held back and sent at each step's head in one copy; None: each sent)
    table_writes: Callable[[Any, Any], Any] | None = None
    # () -> None, in each server process (and `LLM(tp=N)`'s ranks) once it is ready: ext/serving
    # freezes the start-up heap for the garbage collector (None: Python's collector as it is)
    process_ready: Callable[[], None] | None = None
    # () -> None, in a process about to import transformers (`models.hf.transformers_without_torch`,
    # first thing in each server process): ext/perf keeps transformers' index of its modules on
    # disk (None: transformers reads its ~3,000 model files at each import, ~0.6 s of CPU)
    before_transformers: Callable[[], None] | None = None
    # a message type the scheduler process does not know -> (its `scheduler.io.SchedulerServer`,
    # the message) -> None: ext/serving's /flush_cache (none: each is logged and dropped)
    scheduler_messages: dict[type, Callable[[Any, Any], None]] = field(default_factory=dict)
    # a change type rank 0 tells its TP followers (`Scheduler._tell`) that the core does not
    # know -> (the follower's Scheduler, the change) -> None, applied before the step it came
    # with: ext/lora's runtime adapter loads and unloads (none: a follower could not follow)
    tp_changes: dict[type, Callable[[Any, Any], None]] = field(default_factory=dict)
    # (head, shape) -> the writer of a stream's OpenAI chunks, a `server.api_server.Chunks`
    # subclass (ext/perf's formats a choice no extension shapes directly; None: the Chunks)
    stream_chunks: Callable[[dict[str, Any], Any], Any] | None = None
    # (EngineConfig, `LLM`'s scheduler options) -> those options with the extension's defaults
    # for the ones not given (ext/perf: 32k-token prompt chunks on a GPU of >= 70 GiB; None: as
    # given, the server's defaults otherwise)
    llm_defaults: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    # () -> the context manager `LLM.generate` steps its requests in (ext/perf: no automatic
    # garbage collection meanwhile; None: the collector as it is)
    offline_run: Callable[[], Any] | None = None
    # -- points -- (new points go above this line)
    loaded: bool = False  # bookkeeping, not a point: minisgl.ext was imported (extensions())


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


# The options of the extensions that the core knows by name (prefixes, by extension), so that
# without the extension `LLM(...)` and the command line refuse them naming it, not as unknown.
# "dp": --dp, --dp-size, --dp-dispatch, --dp-load-threshold; "data_parallel": --data-parallel-size
EXTENSION_OPTIONS = {
    "spec": "speculative_",
    "perf": "disable_prefill_graphs",
    "structured": "json_any_whitespace tool_call_parser reasoning_parser shell_hide_reasoning "
    "grammar_compile_timeout",
    "serving": "priority_aging api_key dp max_queued_requests request_timeout max_request_bytes "
    "data_parallel exit_with_parent skip_server_warmup chat_template",
    "cpu": "quantization enable_torch_compile cpu_compile cpu_threads",
}


def check_extension_options(names: list[str], flag: bool = False) -> None:
    """ExtensionMissing for the first of `names` (or its `--flag`) a missing extension takes."""
    for name in names:
        key = name.lstrip("-").replace("-", "_")
        for extension, prefixes in EXTENSION_OPTIONS.items():
            if key.startswith(tuple(prefixes.split())):
                raise ExtensionMissing("--" + key.replace("_", "-") if flag else key, extension)
