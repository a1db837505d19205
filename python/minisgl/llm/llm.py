"""Offline batch inference: the scheduler and engine in this process, no server."""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from minisgl.core import SamplingParams
from minisgl.distributed import destroy_tp, free_port, get_tp_info
from minisgl.engine import EngineConfig
from minisgl.engine.engine import check_tp
from minisgl.models import resolve_model_path
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.scheduler.io import build_scheduler, run_follower
from minisgl.utils.options import split_options
from minisgl.utils.procs import wait_ready

Prompt = str | list[int]


class LLM:
    """`LLM(model).generate(prompts, SamplingParams(...))` -> [{"text", "token_ids", ...}].
    `model`: a directory, a .gguf file or a hub id; None: the embedded SmolLM2 GGUF.
    `tp=N`: shard the model over N processes (this one is rank 0; `shutdown` ends the rest).
    `options`: the fields of EngineConfig and SchedulerConfig (the flags of `python -m minisgl`:
    `page_size=4` is `--page-size 4`); TypeError for any other keyword."""

    def __init__(self, model: str | None = None, *, tp: int = 1, **options: Any) -> None:
        engine_options, sched_options = split_options(options, EngineConfig, SchedulerConfig)
        if model is None:
            from minisgl.models.gguf import announce_default_model

            model = announce_default_model()
        if get_tp_info().size > 1:
            raise RuntimeError("another LLM with tp > 1 is running in this process: shut it down")
        config = EngineConfig(model=model, **engine_options)
        sched_config = SchedulerConfig(**sched_options)
        self.workers: list[Any] = []  # TP ranks 1..N-1
        if tp == 1:
            self.scheduler = build_scheduler(config, sched_config, rank=0, tp=1, port=0)
        else:
            config.model = resolve_model_path(model)  # download once, before the other ranks
            self.scheduler = self._start_tp(config, sched_config, tp)
            atexit.register(self.shutdown)  # the other ranks wait for rank 0's word to stop
        self.engine, self.tokenizer = self.scheduler.engine, self.scheduler.tokenizer

    def _start_tp(self, config: EngineConfig, sched_config: SchedulerConfig, tp: int) -> Scheduler:
        import multiprocessing as mp

        check_tp(config, tp)  # before any process starts
        port, ctx = free_port(), mp.get_context("spawn")
        conns = []
        for rank in range(1, tp):
            conn, child = ctx.Pipe(duplex=False)
            args = (config, sched_config, rank, tp, port, child)
            proc = ctx.Process(target=run_follower, args=args, name=f"TP rank {rank}", daemon=True)
            proc.start()
            self.workers.append(proc)
            conns.append(conn)
        try:
            wait_ready(conns, self.workers)  # hello: alive past their imports
            scheduler = build_scheduler(config, sched_config, 0, tp, port)
            wait_ready(conns, self.workers)
        except BaseException:
            destroy_tp()  # the others' collectives fail at once: nobody waits for this rank
            for proc in self.workers:
                proc.kill()
                proc.join()
            self.workers = []
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

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) ready for the assistant's turn."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(
        self,
        conversations: list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        # validate everything before anything runs, so a bad prompt wastes no work
        reqs = [
            self.scheduler.make_request(self.encode(p), sp)
            for p, sp in zip(prompts, sampling_params)
        ]
        for req in reqs:
            if req.grammar is not None:
                req.grammar.wait()  # raises GrammarError (a ValueError) for a bad grammar
        for req in reqs:
            self.scheduler.add_request(req)
        with tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm) as bar:
            done = 0
            while done < len(reqs):
                for out in self.scheduler.step():
                    done += out.finished
                    bar.update(int(out.finished))
        return [self._result(r) for r in reqs]

    def _result(self, req: Any) -> dict[str, Any]:
        ids = req.output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        result = {"text": text, "token_ids": ids, "finish_reason": req.finish_reason}
        if req.error is not None:
            result["error"] = req.error
        return result

    def shutdown(self) -> None:
        """Release the engine; with tp > 1 also stop the other ranks (idempotent)."""
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
