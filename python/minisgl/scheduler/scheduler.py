"""Scheduler: continuous batching over one Engine, one `step()` at a time: the request table,
and sampled tokens turned into results (what a step computes is planner.py's)."""

# Overlap: `step` launches batch N+1 before it reads batch N's tokens; `_launch` advances the
# host state at once (a request that samples gets a PLACEHOLDER token, which the next step
# reads on the device) and `_process` fills it in one step later. TP: rank 0 records the
# changes to its request table (tp.py) and the other ranks replay them (`follow`).

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from minisgl import env
from minisgl.core import PLACEHOLDER, Batch, Req, SamplingParams, check_token_ids
from minisgl.distributed import get_tp_info
from minisgl.engine.engine import Engine, StepOutput
from minisgl.extension import Speculator, StepFeature, extensions
from minisgl.kvcache.manager import KVCacheManager
from minisgl.message import AbortBackendMsg, BatchMsg, DetokenizeMsg, FlushCacheMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.planner import BatchPlanner, reaches_length
from minisgl.scheduler.tp import TPLeader, receive_step


@dataclass
class InFlight:
    """A launched step whose sampled ids are on their way to the host."""

    batch: Batch
    slots: list[int]  # each sampled token's index in its request's tokens (-1: none)
    output: StepOutput
    verifies: bool = False  # speculation: the next step starts where its accepted run ends


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        eos_token_ids: set[int],
        tokenizer: Any | None = None,
    ) -> None:
        self.engine, self.config, self.eos_token_ids = engine, config, eos_token_ids
        self.tokenizer = tokenizer  # for the extensions (grammars)
        self.cache = KVCacheManager(engine.num_pages, engine.page_size, config.cache)
        self.planner = BatchPlanner(engine, self.cache, config)
        tp = get_tp_info()
        self.leader = TPLeader() if tp.size > 1 and tp.rank == 0 else None
        self.follower = tp.size > 1 and tp.rank > 0  # admits what rank 0 admits
        self.requests: dict[int, Req] = {}  # those queued, running, or held by a feature
        self.pending: list[DetokenizeMsg] = []  # results produced outside a forward (abort...)
        self.overlap = not env.disable_overlap_scheduling()
        self.in_flight: InFlight | None = None  # launched step whose tokens are not read yet
        # the extensions: step features (speculative decoding's among them: None, off), speed paths
        exts = extensions()
        self.features: list[StepFeature] = [f for m in exts.step_features if (f := m(self))]
        self.spec = next((f for f in self.features if isinstance(f, Speculator)), None)
        engine.features = self.planner.features = self.features
        self.planner.spec = self.spec
        engine.forward_paths = [p for make in exts.forward_paths if (p := make(self)) is not None]

    # ---- requests in and out -------------------------------------------------------------
    def make_request(
        self, input_ids: list[int], params: SamplingParams, uid: int | None = None
    ) -> Req:
        """Validate and build a request (not yet queued; `params` checked themselves when made)."""
        engine, limit = self.engine, self.engine.max_seq_len
        if not input_ids:
            raise ValueError("prompt is empty")
        if (n := len(input_ids)) >= limit:
            pool = engine.num_pages * engine.page_size  # it, not the context, may be the limit
            pool_fits = pool >= engine.max_model_len
            where = "the context" if pool_fits else f"the KV cache ({pool} tokens)"
            raise ValueError(f"prompt of {n} tokens is longer than {where} (at most {limit - 1})")
        vocab = engine.model_config.vocab_size
        check_token_ids(vocab, prompt=input_ids, stop_token_ids=params.stop_token_ids)
        total = min(limit, len(input_ids) + params.max_tokens)
        req = Req(list(input_ids), len(input_ids), params, max_total_len=total)
        if uid is not None:
            req.uid = uid
        for f in self.features:
            f.request(req)
        return req

    def features_of(self, req: Req) -> list[StepFeature]:  # those that set its `ext`
        return [f for f in self.features if f.name in req.ext] if req.ext else []

    def _tell(self, change: Any) -> None:
        """TP rank 0: a change the other ranks replay with the next step (extensions' too)."""
        if self.leader is not None:
            self.leader.changes.append(change)

    def add_request(self, req: Req) -> None:
        if self.leader is not None:  # the other ranks draw no seed of their own
            params = replace(req.params, seed=req.seed)
            self._tell(UserMsg(req.uid, req.tokens[: req.prompt_len], params))
        self.requests[req.uid] = req
        features = self.features_of(req)
        if req.params.max_tokens == 0 and not any(f.scores_prompt for f in features):
            self._finish(req, "length")  # (scoring a prompt runs its prefill, then ends)
        elif not any(f.holds(req) for f in features):  # a feature that holds it queues it later
            self.planner.waiting.append(req)

    def abort(self, uid: int, error: str | None = None) -> None:
        """End the request: "abort", or "error" with `error` (other ranks: "abort")."""
        self._tell(AbortBackendMsg(uid))
        if (req := self.requests.get(uid)) is not None:
            self._finish(req, "abort" if error is None else "error", error=error)

    def flush_cache(self) -> str | None:
        """Empty the prefix cache (SGLang's /flush_cache); why not, while requests run."""
        if self.has_work or self.cache.prefix_cache.locked_pages:
            return f"cache_busy: {len(self.requests)} requests are running; flush when idle"
        self._tell(FlushCacheMsg())  # the other ranks flush before their next step
        self.cache.reset_cache()
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self.pending or self.in_flight)

    def step(self) -> list[DetokenizeMsg]:
        """Launch the next batch, then process the tokens that are ready (with overlap, the
        previous step's, which ran on the device while this one was built)."""
        # the features' work at its start (admit held requests; speculation: a step that
        # proposes reads the step in flight first, the proposals continue its tokens)
        for f in self.features:
            f.before_step()
        if self.leader is not None:
            self.leader.send()
        # speculation: a step that verifies is read at once (its accepted run sets where the
        # next starts); the steps between overlap as plain decoding does
        batch = self.planner.schedule()
        launched = self._launch(batch) if batch is not None else None
        previous, self.in_flight = self.in_flight, None
        if launched is not None and self.overlap and not launched.verifies:
            self.in_flight, launched = launched, None  # read at the next step
        outputs, self.pending = self.pending, []
        for done in (previous, launched):
            if done is not None:
                outputs.extend(self._process(done))
        return outputs

    def _read_in_flight(self) -> None:  # its outputs wait in `pending`
        if self.in_flight is not None:
            self.pending.extend(self._process(self.in_flight))
            self.in_flight = None

    def follow(self) -> None:
        """Ranks > 0: replay rank 0's changes and step with it, until it stops."""
        while isinstance(msg := receive_step(), BatchMsg):
            for change in msg.msgs:
                if isinstance(change, AbortBackendMsg):
                    self.abort(change.uid)
                elif isinstance(change, FlushCacheMsg):
                    self.cache.reset_cache()  # rank 0 checked that nothing runs
                elif (apply := extensions().tp_changes.get(type(change))) is not None:
                    apply(self, change)  # an extension's: ext/held.py's admissions, ext/lora's...
                else:
                    self.add_request(self.make_request(change.input_ids, change.params, change.uid))
            self.step()

    def stop_followers(self) -> None:
        if self.leader is not None:
            self.leader.send(stop=True)
            self.leader = None

    # ---- one step's phases ---------------------------------------------------------------
    def _launch(self, batch: Batch) -> InFlight | None:
        """Queue the forward and the sampling, then advance the host state as if the step had
        run (None: nothing to read back: prompt chunks, requests ended meanwhile)."""
        # a request samples when the step computes its last known token (or proposals past it)
        ends = [r.cached_len + r.extend_len - len(r.tokens) for r in batch.reqs]
        samples = [end >= 0 for end in ends]
        forward = self.engine.forward(batch, samples)
        prepared = self._prepare(batch, samples) if any(r.ext for r in batch.reqs) else None
        output = self.engine.sample(batch, forward, prepared)
        slots = self._advance(batch, samples)
        if all(slot < 0 for slot in slots) and not output.results:
            return None
        return InFlight(batch, slots, output, verifies=any(end > 0 for end in ends))

    def _prepare(self, batch: Batch, samples: list[bool]) -> dict[str, Any]:
        """The features' host inputs, built while the forward runs; one that needs the step in
        flight's tokens (a grammar's matchers) has it read first."""
        features = [f for f in self.features if any(f.name in r.ext for r in batch.reqs)]
        flight = self.in_flight.batch.reqs if self.in_flight is not None else []
        if any(f.needs_tokens and any(f.name in r.ext for r in flight) for f in features):
            self._read_in_flight()
        return {f.name: p for f in features if (p := f.prepare(batch, samples)) is not None}

    def _advance(self, batch: Batch, samples: list[bool]) -> list[int]:
        """KV covers the computed tokens; a request that samples gets a placeholder: its slot."""
        slots = []
        for i, (req, sampled) in enumerate(zip(batch.reqs, samples)):
            if req.finished:  # by the step in flight, processed in `_prepare`
                slots.append(-1)
                continue
            self.planner.launched(req, batch.is_decode or i < batch.num_decodes, sampled)
            slots.append(len(req.tokens) if sampled else -1)
            if sampled:
                req.tokens.append(PLACEHOLDER)
        return slots

    def _process(self, step: InFlight) -> list[DetokenizeMsg]:
        outputs = []
        out, reqs = step.output, step.batch.reqs
        tokens = out.tokens()  # waits for the copies (the features' results' too)
        values = {}  # per feature that has them, a value per batch row
        for f in self.features:
            if f.name in out.results and (per_row := f.read(reqs, out.results[f.name])) is not None:
                values[f.name] = per_row
        for i, (req, slot, token) in enumerate(zip(reqs, step.slots, tokens)):
            if slot < 0 or req.finished:
                continue  # a prompt chunk that is not the last, or ended meanwhile
            row = {name: v[i] for name, v in values.items()}
            if self.spec is None or (targets := row.get(self.spec.name)) is None:
                outputs.append(self._output(req, slot, token, row))
                continue
            # it verified proposals: the accepted run (tokens from `slot` on), each output as if
            # decoded alone
            for token in self.spec.accept_run(self.engine, req, slot, targets):
                req.tokens.append(PLACEHOLDER)
                outputs.append(self._output(req, len(req.tokens) - 1, token, {}))
                if req.finished:  # a stop ends the run
                    break
        return outputs

    def _output(self, req: Req, slot: int, token: int, values: dict[str, Any]) -> DetokenizeMsg:
        """The request's token at `slot` is known: its output, and its end if it ends it."""
        req.tokens[slot] = token
        eos = token in self.eos_token_ids and not req.params.ignore_eos
        stop = eos or token in req.params.stop_token_ids
        reason = "stop" if stop else "length" if reaches_length(req, slot + 1) else None
        error = None
        features = self.features_of(req)
        for f in features:  # a grammar's matcher takes the token, or ends the request
            reason, error = f.accept(req, token, reason)
            if error is not None:
                break
        output = DetokenizeMsg(req.uid, [token], reason is not None, reason, error)
        for f in features:
            f.output(req, values.get(f.name), output)
        if slot == req.prompt_len:  # the first output
            output.queue_time, output.cached_tokens = req.queue_time, req.cached_tokens
        if reason is not None:
            self._finish(req, reason, report=False, error=error)
        return output

    def _finish(self, req: Req, reason: str, report: bool = True, error: str | None = None) -> None:
        if not req.finished:
            for f in self.features_of(req):
                f.finished(req)
        req.finish_reason, req.error = reason, error  # type: ignore[assignment]
        self.planner.drop(req)
        while req.tokens and req.tokens[-1] == PLACEHOLDER:
            req.tokens.pop()  # tokens of steps launched past the end
        self.requests.pop(req.uid, None)
        if report:
            self.pending.append(DetokenizeMsg(req.uid, [], True, reason, error))

    def shutdown(self) -> None:
        for f in self.features:
            f.shutdown()
