"""Offline batch inference: the scheduler and engine in this process, no server."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

from tqdm import tqdm

from minisgl.core import Req, SamplingParams
from minisgl.distributed import destroy_tp, get_tp_info, rendezvous_file
from minisgl.engine import EngineConfig
from minisgl.engine.config import check_model
from minisgl.extension import ExtensionMissing, extensions, require
from minisgl.message import DetokenizeMsg
from minisgl.models.weight import default_model, resolve_model_path
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler.io import build_scheduler, start_followers
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.detokenize import IncrementalDetokenizer, request_detokenizer
from minisgl.tokenizer.server import encode_chat, needed
from minisgl.utils.options import OptionError
from minisgl.utils.procs import spawn, stop_children, wait_ready

Prompt = str | list[int]
CHAT_TOOLS = ("tools", "tool_choice", "parallel_tool_calls", "tool_call_parser", "reasoning_parser")


@dataclass
class _Sample:
    """One request of `generate`, its text so far (with stop strings) and its outputs."""

    req: Req
    detok: IncrementalDetokenizer | None = None
    text: str = ""
    outputs: list[DetokenizeMsg] = field(default_factory=list)  # for the step features' results


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
    """`LLM(model).generate(prompts, SamplingParams(...))` -> one {"text", "token_ids",
    "finish_reason"} per prompt ({"outputs": [...]} with n > 1, as vLLM's). `tp=N` shards the
    model over N processes; `options`: EngineConfig's and SchedulerConfig's fields."""

    def __new__(cls, model: str | None = None, **options: Any) -> LLM:
        """`dp`, `dp_dispatch`, `dp_load_threshold`: the serving extension's subclass."""
        dp_options = sorted(k for k in options if k.startswith("dp"))
        if cls is not LLM or not dp_options or (dp_options == ["dp"] and options["dp"] == 1):
            return super().__new__(cls)
        if (replicated := extensions().replicas) is None:
            what = f"LLM({dp_options[0]}={options[dp_options[0]]!r})"
            raise OptionError(dp_options[0], str(ExtensionMissing(what, "serving")))
        return super().__new__(replicated())

    def __init__(
        self, model: str | None = None, *, tp: int = 1, dp: int = 1, **options: Any
    ) -> None:  # dp: 1 here (`__new__`)
        if get_tp_info().size > 1:
            raise RuntimeError("another LLM with tp > 1 is running in this process: shut it down")
        model = model or default_model()
        config, self.sched_config = self.configs(model, options)
        self.workers: list[Any] = []  # TP ranks 1..N-1
        self.tp_dir: str | None = None  # private directory of the ranks' rendezvous file
        if tp == 1:
            self.scheduler = build_scheduler(config, self.sched_config, rank=0, tp=1)
        else:
            config.model = resolve_model_path(model)  # download once, before the ranks
            self.scheduler = self._start_tp(config, tp)
            atexit.register(self.shutdown)  # the other ranks wait for rank 0's word to stop
        self.engine, self.tokenizer = self.scheduler.engine, self.scheduler.tokenizer

    @staticmethod
    def configs(model: str, options: dict[str, Any]) -> tuple[EngineConfig, SchedulerConfig]:
        """`options` split into the engine's config and the scheduler's (unknown ones refused)."""
        engine_names = {f.name for f in fields(EngineConfig)}
        config = EngineConfig(model=model, **{k: options[k] for k in engine_names & options.keys()})
        rest = {k: v for k, v in options.items() if k not in engine_names}
        if (defaults := extensions().llm_defaults) is not None:  # ext/perf's 32k chunks
            rest = defaults(config, rest)
        return config, SchedulerConfig.from_options(rest)

    def _start_tp(self, config: EngineConfig, tp: int) -> Scheduler:
        check_model(config, tp)  # before any process starts
        self.tp_dir = tempfile.mkdtemp(prefix="minisgl-tp-")
        rendezvous, start = rendezvous_file(self.tp_dir), partial(spawn, mp.get_context("spawn"))
        started = start_followers(start, config, self.sched_config, tp, rendezvous)
        conns, self.workers = [conn for conn, _ in started], [proc for _, proc in started]
        try:
            wait_ready(conns, self.workers)  # hello: alive past their imports
            scheduler = build_scheduler(config, self.sched_config, 0, tp, rendezvous)
            wait_ready(conns, self.workers)
        except BaseException:
            destroy_tp()  # the others' collectives fail at once: nobody waits for this rank
            self._stop_workers(timeout=0)
            raise
        return scheduler

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return needed(self.tokenizer).encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """The token ids of a chat, ready for the assistant's turn; `kwargs` go to the template."""
        return encode_chat(self.tokenizer, messages, kwargs)

    def chat(
        self,
        conversations: list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        **structured: Any,
    ) -> list[dict[str, Any]]:
        """`generate` on chats. `structured`: tools, tool_choice, parallel_tool_calls and the
        parsers, the structured extension's (docs/features.md; ValueError without it)."""
        params = list(per_prompt(sampling_params, len(conversations)))
        kwargs = chat_template_kwargs or {}
        if (features := extensions().chat_features) is not None:
            options = dict(use_tqdm=use_tqdm, chat_template_kwargs=kwargs, **structured)
            return features.offline_chat(self, conversations, params, **options)
        for name, value in structured.items():  # refused if asked for
            if name not in CHAT_TOOLS:
                raise TypeError(f"LLM.chat() got an unexpected keyword argument {name!r}")
            parser_off = name.endswith("_parser") and value in ("auto", "none")
            if name != "parallel_tool_calls" and value not in (None, [], "") and not parser_off:
                raise ExtensionMissing(name, "structured")
        prompts = [self.apply_chat_template(chat, **kwargs) for chat in conversations]
        return self.generate(prompts, params, use_tqdm)

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[dict[str, Any]]:
        """`lora_request`: vLLM's LoRARequest, or one per prompt (the lora extension's)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        sampling_params = per_prompt(sampling_params, len(prompts))
        if lora_request is not None:
            adapt = require(extensions().lora_request, "lora_request", "lora")
            sampling_params = adapt(self, lora_request, sampling_params)
        return self._generate([self.encode(p) for p in prompts], sampling_params, use_tqdm)

    def _generate(
        self, prompts: list[list[int]], params: Sequence[SamplingParams], use_tqdm: bool
    ) -> list[dict[str, Any]]:
        # every request is made (validated) before any runs, so a bad prompt wastes no work
        groups = [
            [self._sample(ids, sp.for_sample(j)) for j in range(sp.n)]
            for ids, sp in zip(prompts, params)
        ]
        samples = [s for group in groups for s in group]
        for s in samples:  # what holds a request (a grammar compiling) raises its error now
            for feature in self.scheduler.features_of(s.req):
                feature.settle(s.req)
        for s in samples:
            self.scheduler.add_request(s.req)
        running = extensions().offline_run or contextlib.nullcontext  # ext/perf's: no gc
        with running():
            results = self._run(samples, use_tqdm)
        shaped = [[results[s.req.uid] for s in group] for group in groups]
        return [group[0] if len(group) == 1 else {"outputs": group} for group in shaped]

    def _sample(self, ids: list[int], params: SamplingParams) -> _Sample:
        req = self.scheduler.make_request(ids, params)
        if not params.stop or self.tokenizer is None:
            return _Sample(req)
        # the server's detokenizer: the text is cut where the server cuts it
        stop, min_tokens = list(params.stop), params.get("min_tokens")
        return _Sample(req, request_detokenizer(self.tokenizer, ids, True, stop, min_tokens))

    def _run(self, samples: list[_Sample], use_tqdm: bool) -> dict[int, dict[str, Any]]:
        """Each request's result by uid, made as it finishes (while the device runs others)."""
        by_uid = {s.req.uid: s for s in samples}
        results: dict[int, dict[str, Any]] = {}
        with tqdm(total=len(samples), desc="Generating", disable=not use_tqdm) as bar:
            while len(results) < len(samples):
                for out in self.scheduler.step():
                    sample = by_uid[out.uid]
                    if sample.req.ext:  # the step features make the result of its outputs
                        sample.outputs.append(out)
                    detok = sample.detok
                    if detok is not None and out.token_ids and not detok.stopped:
                        sample.text += detok.add(out.token_ids)
                        if detok.stopped and not out.finished:
                            self.scheduler.abort(out.uid)  # as the server does: "stop"
                    if out.finished:
                        results[out.uid] = self._result(sample)
                        bar.update(1)
        return results

    def _result(self, sample: _Sample) -> dict[str, Any]:
        req, detok = sample.req, sample.detok
        if detok is not None:
            text = sample.text + detok.finish()
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        else:
            text = ""
        # aborted by its stop string (one on the last token keeps the scheduler's reason)
        stopped = detok is not None and detok.stopped and req.finish_reason == "abort"
        reason = "stop" if stopped else req.finish_reason
        result = {"text": text, "token_ids": req.output_ids, "finish_reason": reason}
        for feature in self.scheduler.features_of(req):
            result.update(feature.result(req, sample.outputs))
        if req.error is not None:
            result["error"] = req.error
        if self.scheduler.spec is not None:  # speculative decoding's counts
            result.update(self.scheduler.spec.result(req))
        return result

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache so far."""
        return self.scheduler.planner.num_cached_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (every TP rank's), as /flush_cache."""
        busy = self.scheduler.flush_cache()
        if busy is not None:  # (generate returns only when every request is done)
            raise RuntimeError(busy)

    def shutdown(self) -> None:
        """Release the engine; stop the other TP ranks (idempotent)."""
        atexit.unregister(self.shutdown)
        self.scheduler.shutdown()
        self.engine.shutdown()
        if self.workers:
            with contextlib.suppress(RuntimeError):  # a rank already died: nothing to tell it
                self.scheduler.stop_followers()
            self._stop_workers(timeout=15)  # a loaded machine takes seconds to end a rank
            destroy_tp()

    def _stop_workers(self, timeout: float) -> None:
        stop_children(self.workers, timeout)
        self.workers = []
        if self.tp_dir is not None:
            shutil.rmtree(self.tp_dir, ignore_errors=True)
