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
| `chat_features` | `ApiServer.chat_complete` / `.tokenize`, `server.protocol.chat_messages`, `ServerArgs`, `Launcher.resolve_models`, `LLM.chat`, `shell.make_printers` | tool calls and reasoning: checks the parser flags, picks the `auto` ones from the chat template, validates tools, constrains forced calls, splits each message / stream delta into content, reasoning_content and tool_calls | `ext/structured/features.py: StructuredChat` |
| `gguf_model` | `models.weight.resolve_model_path` | a `.gguf` file → a checkpoint directory (converted once, cached) | `ext/cpu/gguf.py: resolve_gguf` |
| `default_model` | `models.weight.default_model` (`LLM()`, `python -m minisgl` without `--model`) | the model file to use, announced | `ext/cpu/gguf.py: announce_default_model` (SmolLM2 GGUF) |
| `default_model_name` | `python -m minisgl` without `--model` nor `--served-model-name` | the served model id of the default model | `ext/cpu/gguf.py: DEFAULT_NAME` (`SmolLM2-135M-Instruct`) |
| `cpu_dtype` | `engine.engine._resolve_dtype` | what `--dtype auto` means on cpu | `ext/cpu/policy.py: auto_dtype` (bf16 for quantized weights) |
| `model_transform` | `Engine.__init__`, `Engine._build_model` | changes the model before / after its weights load | `ext/cpu/quantize.py: CpuModelTransform` (`--quantization`) |
| `decoder_transform` | `Engine.__init__` | the decoder of one-request decode steps | `ext/cpu/torch_compile.py` (`--enable-torch-compile`) |
| `generate_extras` | `ApiServer.generate` | checks /generate's undeclared fields (none: each is a 400) | `ext/serving/sglang.py: check_generate_extras` (SGLang's at their defaults) |
| `request_observer` | `Frontend.__init__` (its replies, aborts), `Gate` (its responses) | counts what the API process sees of its requests | `ext/serving/metrics.py: Metrics` (Prometheus, /metrics) |
| `dispatcher` | `tokenizer.server.run_tokenizer` (`--dp` > 1), `LLM.__init__` | which data-parallel replica each request goes to | `ext/serving/dispatch.py: Dispatcher` (`--dp-dispatch prefix`: longest indexed prefix) |
| `replicas` | `LLM.__init__` (`dp` > 1) | `LLM(dp=N)`'s N replica processes and their calls | `ext/serving/replicas.py: Replicas` |
| `error_bodies` | `server.gate.Gate` (its refusals: 401, 413, 400...) | the error body on an API's paths, for clients that expect another shape than OpenAI's | `ext/agent/messages.py: error_body` (Anthropic's on /v1/messages) |
| `sampling_params` | `SamplingParams.validate` | checks and normalizes the SamplingParams fields an extension implements (core.EXTENSION_PARAMS); a field set without its extension is refused | `ext/sampling/params.py: check_sampling` (logit_bias's string keys -> ids) |
| `step_features` | `Scheduler.__init__` (its hooks: `make_request`, `add_request`, `step`, `_launch`, `_process`, `_finish`; `Engine.forward_step` / `sample_step`; `BatchPlanner.admit`) | a feature of the steps (`StepFeature`): per-request state in `Req.ext`, requests held before admission, logits processors, observers of raw logits and hidden states, token acceptance | `ext/sampling/adjust.py: LogitAdjust` (logit_bias, min_tokens, penalties), `ext/sampling/logprobs.py: Logprobs`, `ext/structured/grammar_feature.py: GrammarFeature` |
| `options` | `server.args.build_parser`, `ServerArgs` | an extension's own flags: a dataclass of `option(...)` fields, listed in --help under the extension, parsed into `ServerArgs.extras[name]` | `ext/serving/options.py: ServingOptions` (--max-connections, --watchdog-timeout...) |
| `gate` | `server.api_server.create_app` | the ASGI middleware every HTTP request passes (a `server.gate.Gate`) | `ext/serving/http.py: ServingGate` (requests in progress 503, --timeout-body-read 408) |
| `launcher` | `server.launch.launch_server` | the server's processes: a `server.launch.Launcher` subclass | `ext/serving/scale.py: ServingLauncher` (--api-server-count, --nnodes, the gc flags) |
| `http_server` | `server.launch.http_server` | the uvicorn server of an API process | `ext/serving/http.py: serving_http_server` (--max-connections, drain that ends requests with an error) |
| `scheduler_options` | `server.args.build_parser`, `parse_args`, `LLM.__init__` | an extension's options that configure the schedulers: as `options`, but parsed into `SchedulerConfig.extras[name]` (every scheduler process gets them) and keywords of `LLM(...)` | `ext/spec/options.py: SpecOptions` (--speculative-algorithm...) |
| `engine_config` | `scheduler.io.build_scheduler` | the EngineConfig a scheduler builds its engine with | `ext/spec/proposers.py: leave_room_for_draft` (the target's share of the KV memory) |
| `proposer` | `Scheduler.__init__` (its hooks: `step`, `_process`; `BatchPlanner._schedule_decode` / `release`; `Engine.sample_step`) | speculative decoding (`Speculator`): proposals for the next decode step, their verification, the tokens accepted | `ext/spec/speculator.py: make_speculation` (`Speculation`) |
| `forward_paths` | `Scheduler.__init__` (its hooks: `Engine._forward`, `BatchPlanner.schedule`) | speed paths (`ForwardPath`) for the batches the decode graphs cannot replay as they are, and the prompt budget that fits them | `ext/spec/verify.py: VerifyRows` (a verify step as graph rows), `ext/perf/prefill_rows.py: PrefillRows` |
| `admission_policies` | `scheduler.queue.make_queue` (`BatchPlanner`), `SchedulerConfig` | a --schedule-policy: the waiting queue's order and which running request a waiting one may preempt | `ext/serving/policy.py: PriorityQueue` (`--schedule-policy priority`, the request's `priority`) |
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
        reasoning_parser; also `auto` and `none`)."""
        ...

    def resolve_parsers(self, args: Any, model_path: str) -> None:
        """At start: ServerArgs `args`' tool_call_parser / reasoning_parser `auto` become the
        formats the model's chat template shows (None: none), logged; `none` becomes None."""
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


class Observation(Protocol):
    """What a `StepFeature` reads of a step's raw logits, on its way to the host."""

    def finish(self, next_ids: torch.Tensor) -> None:
        """The step's sampled ids [B] are queued: compute what needs them, queue the copies
        to the host (the step's event, recorded after this, covers them)."""
        ...


class StepFeature:
    """A feature of the scheduler's steps (logprobs, logit adjustments, grammars), one object
    per Scheduler, made by a `step_features` factory. A request it acts on holds its state in
    `req.ext[name]` (set by `request`); the hooks marked "its" see only such requests, and a
    step none of whose requests has any `ext` calls none of them (the core pays nothing). In a
    step (vLLM v1's EngineCore.step): schedule -> forward -> `observe` (raw logits) -> `process`
    (in stage order, in place) -> sample (eagerly when some row's logits change) -> `read` /
    `output` / `accept` per token. Every hook does nothing by default."""

    name = ""  # its key in Req.ext and in a step's results
    stage = 0  # processors run in stage order: a mask (0) before the adjustments (1) it bounds

    # ---- requests (Scheduler) ----
    def request(self, req: Any) -> None:
        """make_request: check the request against the model (ValueError), and set
        req.ext[name] if the feature acts on it."""

    def holds(self, req: Any) -> bool:
        """add_request, its: keep it out of the planner's queue (Scheduler.held) until `poll`
        releases it."""
        return False

    def poll(self, held: list[Any]) -> tuple[list[Any], list[tuple[Any, str]]]:
        """Rank 0 before each step, its held requests: those to admit now and (request, error)
        for those that end. Never waits. TP followers admit at rank 0's word."""
        return [], []

    def settle(self, req: Any) -> None:
        """Offline (`LLM.generate`, before anything runs), its: wait for what holds the
        request; raise its error (ValueError)."""

    def scores_prompt(self, req: Any) -> bool:
        """Its: max_tokens=0 still runs the prompt's prefill (prompt log-probabilities)."""
        return False

    def prefix_limit(self, req: Any) -> int | None:
        """Its, at admission: how many leading tokens the prefix cache may supply at most."""
        return None

    def admitted(self, req: Any) -> None:
        """Every request given a page-table row (req.table_idx): what the row's previous
        request left there is the feature's to clear."""

    def launched(self, req: Any) -> None:
        """Its forward is queued (req.cached_len / extend_len not advanced yet)."""

    def finished(self, req: Any) -> None:
        """Its end (once; before the core releases it)."""

    def shutdown(self) -> None:
        """The scheduler stops."""

    # ---- a step's logits (Engine) ----
    def changes_logits(self, req: Any) -> bool:
        """Its: `process` may change the request's logits (its rows sample eagerly after)."""
        return False

    def needs_tokens(self) -> bool:
        """`prepare` reads the tokens of the step in flight (no overlap for such a step)."""
        return False

    def prepare(self, batch: Any, samples: list[bool]) -> Any:
        """Host input of `process` (e.g. a grammar's token mask), built while the forward
        runs; None: nothing to do this step."""
        return None

    def observe(self, engine: Any, batch: Any, logits: torch.Tensor, changes: bool) -> Any:
        """The step's raw logits [B, V], before any processor (`changes`: some will change
        them in place): an `Observation` whose result travels with the step's tokens, or
        None."""
        return None

    def observe_prompt(self, engine: Any, batch: Any, hidden: torch.Tensor) -> Any:
        """An eager prefill's hidden states [num_tokens, H]: a result queued to the host (its
        copies before the step's event), or None."""
        return None

    def process(self, engine: Any, batch: Any, out: Any, prepared: Any, masked: bool) -> bool:
        """A logits processor: changes `out.logits` (a ForwardOutput's) in place before
        sampling (`prepared`: `prepare`'s result; `masked`: an earlier processor set logits to
        -inf). True when it masked logits itself."""
        return False

    # ---- a step's outputs (Scheduler, on the host) ----
    def read(self, reqs: list[Any], result: Any) -> list[Any] | None:
        """The step's result (of `observe` / `observe_prompt`) on the host, after its copy:
        a value per batch row for `output`, or None."""
        return None

    def output(self, req: Any, value: Any, output: Any) -> None:
        """Its row's `read` value into the request's TokenOutput."""

    def accept(self, req: Any, token: int, reason: str | None) -> tuple[str | None, str | None]:
        """Its token, with the core's finish reason: (finish reason, error)."""
        return reason, None


class Speculator:
    """Speculative decoding (`minisgl/ext/spec`), one object per Scheduler made by the
    `proposer` point (None: off, and the core calls none of this). Before each decode step some
    running requests propose tokens after their last (`propose`); the planner grows their
    pages for them and writes them into the token table after the last token, so the step
    computes them with it: an extend over the request's KV, one row of `extend_len` = 1 +
    proposals (a running request that computes past its last token verifies). The engine
    samples the target's token at each of those positions (`verify`: its result goes into
    the step's results under `name`) and the scheduler outputs the run the target agrees with
    (`accept`) and drops the KV of the rest. A step that proposes waits for the step in flight
    (the proposals continue its tokens, `wants`); a step that verifies is read before the
    next is planned (its accepted run sets where the next starts)."""

    name = "spec"  # its key in a step's results

    def wants(self, running: list[Any]) -> bool:
        """Whether the next decode step proposes for some of the running requests."""
        return False

    def propose(self, running: list[Any]) -> dict[int, list[int]]:
        """uid -> proposals of the running requests for the next decode step (called once for
        every decode step planned); a request without room for them decodes one token."""
        return {}

    def verify(self, engine: Any, batch: Any, out: Any) -> None:
        """An eager prefill or mixed step (`out`: its ForwardOutput, `hidden` set): the target's
        token at every position of the rows that verify, queued to the host into
        `out.results[name]` (before the step's event)."""

    def verified(self, result: Any) -> dict[int, list[int]]:
        """A step's result on the host (after its copy): batch row -> the target's token at
        each position the row computed."""
        return {}

    def accept(self, req: Any, targets: list[int]) -> list[int]:
        """The tokens a verified row adds: its proposals up to the first the target disagrees
        with, then the target's own token there."""
        return targets[:1]

    def result(self, req: Any) -> dict[str, Any]:
        """Its counts in the request's offline result (`LLM.generate`)."""
        return {}

    def counts(self) -> dict[str, int]:
        """Running totals for the server's stats (`SchedulerStats.counts`)."""
        return {}

    def reset_counts(self) -> None:
        """The totals back to zero (after the warm-up)."""

    def release(self, req: Any) -> None:
        """The request leaves the running set (ends, or is preempted)."""

    def shutdown(self) -> None:
        """The scheduler stops."""


class ForwardPath:
    """A speed path of the engine's forward (`forward_paths`, one object per Scheduler): a
    batch that the decode graphs cannot replay as it is (a prefill, a verify step) run
    another way, e.g. as one graph row per position; and the prompt budget of a step that
    makes it fit such a path. Its `ForwardOutput` has one row per request, or keeps its own
    rows in `rows` with `regroup` mapping their sampled ids to the batch's."""

    def forward(self, engine: Any, batch: Any, samples: list[bool], resample: bool) -> Any:
        """The batch's queued ForwardOutput, or None: the next path, else the eager step."""
        return None

    def prefill_budget(
        self, planner: Any, budget: int, decodes: list[Any], num_decode_tokens: int
    ) -> int:
        """The prompt tokens the planner may schedule beside `decodes` (at most `budget`)."""
        return budget


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
    # the short id the server gives default_model's model (/v1/models; None: its path)
    default_model_name: str | None = None
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
    # extension name -> the dataclass of its flags (`option(...)` fields; an optional
    # `check(args)` cross-checks them against the ServerArgs): --help lists them under the
    # extension, `ServerArgs.extras[name]` holds them parsed (without it: unknown flags)
    options: dict[str, type] = field(default_factory=dict)
    # (app, args, frontend, paths) -> the ASGI middleware every HTTP request passes: a
    # `server.gate.Gate` subclass (None: the Gate, API key, body size, valid Unicode)
    gate: Callable[..., Any] | None = None
    # (args, app, frontend, on_shutdown) -> the uvicorn server an API process runs `app` with
    # (None: plain uvicorn, `server.launch.plain_http_server`)
    http_server: Callable[..., Any] | None = None
    # SamplingParams field -> the check of the extension that implements it (normalizes in
    # place, ValueError); a field set without it is refused (core.EXTENSION_PARAMS)
    sampling_params: dict[str, Callable[[Any], None]] = field(default_factory=dict)
    # (scheduler) -> a feature of its steps, or None when it has nothing to do there
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
    # extension name -> the dataclass of its options that configure the schedulers: as
    # `options`, parsed into `SchedulerConfig.extras[name]`, and keywords of `LLM(...)`
    scheduler_options: dict[str, type] = field(default_factory=dict)
    # (engine config, scheduler config) -> the EngineConfig a scheduler builds its engine with
    engine_config: list[Callable[[Any, Any], Any]] = field(default_factory=list)
    # (scheduler) -> its speculative decoding, or None when off (the core then proposes nothing)
    proposer: Callable[[Any], Speculator | None] | None = None
    # (scheduler) -> a speed path of its engine's forward and planner, or None (off)
    forward_paths: list[Callable[[Any], ForwardPath | None]] = field(default_factory=list)
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


# The options of the extensions that the core knows by name (a prefix), so that without the
# extension `LLM(...)` and the command line refuse them naming it, not as unknown.
EXTENSION_OPTIONS = {"speculative_": "spec", "disable_prefill_graphs": "perf"}


def check_extension_options(names: list[str], flag: bool = False) -> None:
    """ExtensionMissing (naming the option, or its `--flag`) for the first of `names` that an
    extension missing here would take."""
    for name in names:
        key = name.lstrip("-").replace("-", "_")
        for prefix, extension in EXTENSION_OPTIONS.items():
            if key.startswith(prefix):
                raise ExtensionMissing("--" + key.replace("_", "-") if flag else key, extension)
