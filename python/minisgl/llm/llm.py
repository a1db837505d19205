"""Offline batch inference: the scheduler and engine in this process, no server."""

from __future__ import annotations

import atexit
import contextlib
import gc
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from tqdm import tqdm

from minisgl.core import Req, SamplingParams
from minisgl.distributed import destroy_tp, get_tp_info, rendezvous_file
from minisgl.engine import EngineConfig
from minisgl.engine.engine import check_model
from minisgl.extension import ExtensionMissing, extensions, require
from minisgl.models import default_model, resolve_model_path
from minisgl.models.hf import load_tokenizer
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.scheduler.io import build_scheduler, run_follower
from minisgl.scheduler.scheduler import TokenOutput
from minisgl.tokenizer.detokenize import IncrementalDetokenizer
from minisgl.utils.options import OptionError
from minisgl.utils.procs import wait_ready

Prompt = str | list[int]


@dataclass
class _Sample:
    """One request of `generate`; with stop strings, the text the server's detokenizer would
    send so far (cut before the first stop string)."""

    req: Req
    detok: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[list[Any]] = field(default_factory=list)  # [token, logprob, ids, logprobs]
    prompt_logprobs: list[list[Any]] | None = None

    def add(self, out: TokenOutput) -> bool:
        """Feed a step's output; True when a stop string has just ended the output."""
        if out.logprob is not None:  # shaped at the end: no per-step work beyond the append
            self.logprobs.append([out.token, *out.logprob])
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        token = out.token
        if self.detok is None or token is None or self.detok.stopped:
            return False
        self.text += self.detok.add([token])
        return self.detok.stopped


def logprob_dicts(entries: list[list[Any]]) -> list[dict[int, float] | None]:
    """vLLM's shape, per position: token id -> log-probability, the top alternatives and the
    token itself; None where nothing predicts the token (a prompt's first)."""
    return [
        None if logprob is None else _with(dict(zip(top_ids, top_logprobs)), token, logprob)
        for token, logprob, top_ids, top_logprobs in entries
    ]


def _with(top: dict[int, float], token: int, logprob: float) -> dict[int, float]:
    top[token] = logprob  # in place: no second dict per position
    return top


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic garbage collection while generating: the outputs gathered so far (with
    logprobs, several small objects a token) are long-lived, and each full collection would
    walk them all, a cost that grows with the run and lands in whatever allocates next."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> Sequence[SamplingParams]:
    """One SamplingParams per prompt (one given, or none: the same for all)."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


class LLM:
    """`LLM(model).generate(prompts, SamplingParams(...))` -> [{"text", "token_ids", ...}], one
    per prompt; a prompt with `n > 1` samples gets {"outputs": [n such dicts]} (vLLM's
    `RequestOutput.outputs`).
    `model`: a directory, a .gguf file or a hub id; None: the embedded SmolLM2 GGUF.
    `tp=N`: shard the model over N processes (this one is rank 0; `shutdown` ends the rest).
    `dp=N`: N data-parallel replicas, each a whole engine with its `tp` GPUs (dp x tp in all; on
    CPU a share of the cores) in a process of its own; each prompt goes to the replica holding
    its longest prefix (`dp_dispatch="prefix"`, new prefixes to the least loaded, as the
    server's --dp-dispatch and --dp-load-threshold) or in turn (`"round_robin"`). With dp > 1
    this object holds the tokenizer only: no `scheduler` or `engine` attribute.
    `options`: the fields of EngineConfig and SchedulerConfig (the flags of `python -m minisgl`:
    `page_size=4` is `--page-size 4`); TypeError for any other keyword."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tp: int = 1,
        dp: int = 1,
        dp_dispatch: str = "prefix",
        dp_load_threshold: int = 8,
        **options: Any,
    ) -> None:
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"LLM(dp={dp!r}): the number of replicas must be an int >= 1")
        # the rest are SchedulerConfig's, the extensions' scheduler options among them
        engine_names = {f.name for f in fields(EngineConfig)}
        engine_options = {k: v for k, v in options.items() if k in engine_names}
        sched_options = {k: v for k, v in options.items() if k not in engine_names}
        if model is None:  # the embedded GGUF (cpu extension), announced
            model = default_model()
        if get_tp_info().size > 1:
            raise RuntimeError("another LLM with tp > 1 is running in this process: shut it down")
        config = EngineConfig(model=model, **engine_options)
        self.sched_config = SchedulerConfig.from_options(sched_options)
        self.workers: list[Any] = []  # TP ranks 1..N-1
        self.tp_dir: str | None = None  # private directory of the ranks' rendezvous file
        self.replicas: Any = None  # dp > 1: the serving extension's replica processes
        exts = extensions()  # the serving extension's: a bad policy fails here, also with dp = 1
        dispatch = (dp, config.page_size, dp_dispatch, dp_load_threshold)
        dispatcher = None if exts.dispatcher is None else exts.dispatcher(*dispatch)
        if dp > 1:
            if exts.replicas is None or dispatcher is None:
                raise OptionError("dp", str(ExtensionMissing(f"LLM(dp={dp})", "serving")))
            path = resolve_model_path(model)  # download once, before the replicas
            self.tokenizer = load_tokenizer(path)
            self.replicas = exts.replicas(LLM, path, tp, dp, options, dispatcher)
            atexit.register(self.shutdown)
            return
        if tp == 1:
            self.scheduler = build_scheduler(config, self.sched_config, rank=0, tp=1)
        else:
            config.model = resolve_model_path(model)  # download once, before the other ranks
            self.scheduler = self._start_tp(config, self.sched_config, tp)
            atexit.register(self.shutdown)  # the other ranks wait for rank 0's word to stop
        self.engine, self.tokenizer = self.scheduler.engine, self.scheduler.tokenizer

    def _start_tp(self, config: EngineConfig, sched_config: SchedulerConfig, tp: int) -> Scheduler:
        import multiprocessing as mp

        check_model(config, tp)  # before any process starts
        ctx, self.tp_dir = mp.get_context("spawn"), tempfile.mkdtemp(prefix="minisgl-tp-")
        rendezvous = rendezvous_file(self.tp_dir)
        conns = []
        for rank in range(1, tp):
            conn, child = ctx.Pipe(duplex=False)
            args = (config, sched_config, rank, tp, rendezvous, child)
            proc = ctx.Process(target=run_follower, args=args, name=f"TP rank {rank}", daemon=True)
            proc.start()
            self.workers.append(proc)
            conns.append(conn)
        try:
            wait_ready(conns, self.workers)  # hello: alive past their imports
            scheduler = build_scheduler(config, sched_config, 0, tp, rendezvous)
            wait_ready(conns, self.workers)
        except BaseException:
            destroy_tp()  # the others' collectives fail at once: nobody waits for this rank
            for proc in self.workers:
                proc.kill()
                proc.join()
            self.workers = []
            shutil.rmtree(self.tp_dir, ignore_errors=True)
            raise
        return scheduler

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of a chat (list of {"role", "content", ...}) ready for the assistant's
        turn; `kwargs` go to the template (`tools`, `enable_thinking`...)."""
        return self._chat_tokenizer().encode(
            self._render(messages, kwargs), add_special_tokens=False
        )

    def _chat_tokenizer(self) -> Any:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        return self.tokenizer

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        return self._chat_tokenizer().apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )

    def chat(
        self,
        conversations: list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str | None = "auto",
        reasoning_parser: str | None = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """`generate` on chats; `chat_template_kwargs` go to the template. Tools and parsers are
        the structured extension's (ValueError without it): `tools`, OpenAI's function list, is
        rendered by the chat template; with parsers (vLLM's names, as the server's
        --tool-call-parser / --reasoning-parser), each result (each of `outputs` when n > 1)
        also holds the parsed "content", "reasoning_content" and "tool_calls" (OpenAI's
        shapes). `tool_choice` as OpenAI's (default auto with tools): "required" or {"type":
        "function", "function": {"name": ...}} forces calls by grammar (one when not
        `parallel_tool_calls`; required needs a `tool_call_parser`). The parsers' "auto" (the
        default) is the format the chat template shows, "none" none (without the extension
        both mean none). With `reasoning_parser`, a sampling constraint (json_schema, regex,
        ebnf) applies to the answer after the reasoning, as on the server."""
        params = per_prompt(sampling_params, len(conversations))
        options: dict[str, Any] = dict(
            tools=tools,
            tool_choice=tool_choice,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        # a parser's "auto" / "none" asks for nothing in particular (no extension: none)
        asked = [
            k
            for k, v in options.items()
            if v not in (None, [], "") and not (k.endswith("_parser") and v in ("auto", "none"))
        ]
        detect = "auto" in (tool_call_parser, reasoning_parser)
        if asked or (detect and extensions().chat_features is not None):
            what = asked[0] if asked else "tool_call_parser"
            features = require(extensions().chat_features, what, "structured")
            options.update(parallel_tool_calls=parallel_tool_calls, use_tqdm=use_tqdm)
            options.update(chat_template_kwargs=chat_template_kwargs)
            return features.offline_chat(self, conversations, list(params), **options)
        _, prompts = self.chat_prompts(conversations, dict(chat_template_kwargs or {}))
        return self.generate(prompts, params, use_tqdm)

    def chat_prompts(
        self, conversations: list[list[dict[str, Any]]], kwargs: dict[str, Any]
    ) -> tuple[list[str], list[list[int]]]:
        """The chats as the template renders them (`kwargs`: its arguments): texts, token ids."""
        texts = [self._render(c, kwargs) for c in conversations]
        return texts, [self._chat_tokenizer().encode(t, add_special_tokens=False) for t in texts]

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        sampling_params = per_prompt(sampling_params, len(prompts))
        if self.replicas is not None:
            ids = [self.encode(p) for p in prompts]
            return self.replicas.generate(ids, sampling_params, use_tqdm)
        # validate everything before anything runs, so a bad prompt wastes no work
        groups = [
            [self._sample(self.encode(p), sp.for_sample(j)) for j in range(sp.n)]
            for p, sp in zip(prompts, sampling_params)
        ]
        samples = [s for group in groups for s in group]
        for s in samples:  # what holds a request (a grammar compiling) raises its error now
            for feature in self.scheduler.features_of(s.req):
                feature.settle(s.req)
        for s in samples:
            self.scheduler.add_request(s.req)
        with _gc_paused():
            results = self._run(samples, use_tqdm)
        shaped = [[results[s.req.uid] for s in group] for group in groups]
        return [group[0] if len(group) == 1 else {"outputs": group} for group in shaped]

    def _sample(self, ids: list[int], params: SamplingParams) -> _Sample:
        req = self.scheduler.make_request(ids, params)
        if not params.stop or self.tokenizer is None:
            return _Sample(req)
        # the server's detokenizer: the offline text is cut exactly as the server's
        detok = IncrementalDetokenizer(
            self.tokenizer, ids, True, list(params.stop), params.min_tokens
        )
        return _Sample(req, detok)

    def _run(self, samples: list[_Sample], use_tqdm: bool) -> dict[int, dict[str, Any]]:
        """Each request's result by uid, shaped as it finishes: while the device runs the
        others' steps, so the host work (text, logprob dicts) hides behind them."""
        by_uid = {s.req.uid: s for s in samples}
        results: dict[int, dict[str, Any]] = {}
        with tqdm(total=len(samples), desc="Generating", disable=not use_tqdm) as bar:
            while len(results) < len(samples):
                for out in self.scheduler.step():
                    sample = by_uid[out.uid]
                    if sample.add(out) and not out.finished:
                        self.scheduler.abort(out.uid)  # as the server does; reported as "stop"
                    if out.finished:
                        results[out.uid] = self._result(sample)
                        bar.update(1)
        return results

    def _result(self, sample: _Sample) -> dict[str, Any]:
        req, detok = sample.req, sample.detok
        ids = req.output_ids
        if detok is not None:
            text = sample.text + detok.finish()
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        # aborted by its stop string (a stop string on the last token keeps the scheduler's
        # reason, as the server reports it)
        stopped = detok is not None and detok.stopped and req.finish_reason == "abort"
        reason = "stop" if stopped else req.finish_reason
        result: dict[str, Any] = {"text": text, "token_ids": ids, "finish_reason": reason}
        if req.params.logprobs is not None:
            result["logprobs"] = logprob_dicts(sample.logprobs)
        if req.params.prompt_logprobs is not None:
            result["prompt_logprobs"] = logprob_dicts(sample.prompt_logprobs or [])
        if req.error is not None:
            result["error"] = req.error
        if self.scheduler.spec is not None:  # speculative decoding's counts
            result.update(self.scheduler.spec.result(req))
        return result

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache so far (all replicas')."""
        if self.replicas is not None:
            return sum(self.replicas.call_all("_cached_tokens"))
        return self._cached_tokens()

    def _cached_tokens(self) -> int:
        return self.scheduler.planner.num_cached_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (all replicas', every TP rank's), e.g. between timed
        runs: the scheduler's flush, as the server's /flush_cache."""
        if self.replicas is not None:
            self.replicas.call_all("reset_prefix_cache")
            return
        busy = self.scheduler.flush_cache()
        if busy is not None:  # (generate returns only when every request is done)
            raise RuntimeError(busy)

    def shutdown(self) -> None:
        """Release the engine; with tp > 1 also stop the other ranks, with dp > 1 the replicas
        (idempotent)."""
        if self.replicas is not None:
            atexit.unregister(self.shutdown)
            self.replicas.shutdown()
            return
        self.scheduler.shutdown()
        self.engine.shutdown()
        if not self.workers:
            return
        atexit.unregister(self.shutdown)
        try:
            self.scheduler.stop_followers()
        except RuntimeError:
            pass  # a rank already died: nothing to tell it
        for proc in self.workers:
            proc.join(timeout=15)  # a loaded machine can take seconds to tear a rank down
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.workers = []
        destroy_tp()
        if self.tp_dir is not None:
            shutil.rmtree(self.tp_dir, ignore_errors=True)
