"""Scheduler: continuous batching over one Engine, one `step()` at a time. It keeps the request
table and turns sampled tokens into results; what a step computes is the BatchPlanner's
(planner.py), grammars are GrammarState's (grammar.py), TP replication is TPLeader's (tp.py).

A step has explicit phases: admit the constrained requests whose grammar has compiled (they
wait for it outside the planner's queue; TP followers admit at rank 0's word); plan the batch;
queue its forward (`Engine.forward_step`); for a batch with a constrained request, read the
step in flight (its tokens advance the matchers: no overlap for that step) and build the token
mask while the device runs the forward; queue the sampling (`Engine.sample_step`). Overlap:
`step` launches batch N+1 before it reads batch N's tokens; `_launch` advances the host state
at once (a request that samples gets a PLACEHOLDER token, which the next step reads on the
device) and `_process` fills it one step later."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from minisgl import env
from minisgl.core import PLACEHOLDER, Batch, Req, SamplingParams, check_token_ids
from minisgl.distributed import get_tp_info
from minisgl.engine import Engine
from minisgl.engine.engine import StepOutput
from minisgl.engine.logprobs import Entry
from minisgl.engine.sample import TokenMask
from minisgl.kvcache import KVCacheManager
from minisgl.message import AbortBackendMsg, AdmitBackendMsg, BatchBackendMsg, FlushCacheMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.grammar import GrammarState
from minisgl.scheduler.planner import BatchPlanner, reaches_length
from minisgl.scheduler.spec import accept
from minisgl.scheduler.tp import TPLeader, receive_step

# the warm-up's prompt lengths: short and long, off and on multiples of 16 (Triton specializes
# integer arguments on divisibility by 16), over a page or several
WARMUP_PROMPT_LENS = (5, 16, 33, 64, 130, 250, 513, 1000)


@dataclass
class TokenOutput:
    uid: int
    token: int | None  # None when the request ends without a new token (abort, max_tokens=0)
    finished: bool
    finish_reason: str | None = None
    error: str | None = None  # with finish_reason "error"
    logprob: Entry | None = None  # the token's, when the request asked for logprobs
    queue_time: float | None = None  # with the first output: seconds queued before its prefill
    # with the first output: [token id, logprob | None, top ids, top logprobs] per prompt token
    prompt_logprobs: list[list[Any]] | None = None


@dataclass
class InFlight:
    """A launched step: its batch, where each sampled token goes in its request's tokens
    (-1: none), and the device-to-host copy of the sampled ids."""

    batch: Batch
    slots: list[int]
    output: StepOutput

    @property
    def empty(self) -> bool:
        return all(slot < 0 for slot in self.slots) and self.output.prompt is None

    @property
    def verifies(self) -> bool:
        """Some request verifies proposals: the next step starts where its accepted run ends."""
        return any(r.drafts for r in self.batch.reqs)


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        eos_token_ids: set[int],
        tokenizer: Any | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer  # for grammars
        self.cache = KVCacheManager(engine.num_pages, engine.page_size, config.cache)
        tp = get_tp_info()
        self.planner = BatchPlanner(engine, self.cache, config, eos_token_ids)
        self.leader = TPLeader() if tp.size > 1 and tp.is_primary else None
        self.follower = tp.size > 1 and not tp.is_primary  # admits what rank 0 admits
        rows, vocab = engine.config.max_running_requests, engine.model_config.vocab_size
        pin, any_whitespace = engine.device.type == "cuda", config.json_any_whitespace
        timeout = config.grammar_compile_timeout
        self.grammar = GrammarState(vocab, rows, pin, any_whitespace, timeout, not self.follower)
        self.requests: dict[int, Req] = {}
        self.pending: list[TokenOutput] = []  # results produced outside a forward (abort, ...)
        # speculative decoding: a step that proposes waits for the step in flight (proposals
        # continue its tokens) and is read before the next (its accepted run sets where that
        # one starts); the steps between overlap as plain decoding does (planner.backoff)
        self.overlap = not env.disable_overlap_scheduling()
        self.in_flight: InFlight | None = None  # launched step whose tokens are not read yet

    # ---- requests in and out -------------------------------------------------------------
    def make_request(
        self, input_ids: list[int], params: SamplingParams, uid: int | None = None
    ) -> Req:
        """Validate and build a request (not yet queued)."""
        params.validate()
        limit = self.engine.max_seq_len
        vocab = self.engine.model_config.vocab_size
        if not input_ids:
            raise ValueError("prompt is empty")
        if len(input_ids) >= limit:
            pool = self.engine.num_pages * self.engine.page_size
            small = pool < self.engine.max_model_len  # the KV cache, not the model, limits it
            where = f"the KV cache ({pool} tokens)" if small else "the context"
            raise ValueError(
                f"prompt of {len(input_ids)} tokens is longer than {where}: at most {limit - 1} allowed"
            )
        check_token_ids(vocab, prompt=input_ids, **params.token_id_fields())
        total = min(limit, len(input_ids) + params.max_tokens)
        req = Req(list(input_ids), len(input_ids), params, max_total_len=total)
        if uid is not None:
            req.uid = uid
        req.grammar = self.grammar.constraint(params, self.tokenizer, self.eos_token_ids)
        return req

    def add_request(self, req: Req) -> None:
        if self.leader is not None:
            self.leader.added(req)
        self.requests[req.uid] = req
        self.grammar.num_constrained += req.grammar is not None
        req.queued_at = time.monotonic()
        if req.params.max_tokens == 0 and req.params.prompt_logprobs is None:
            self._finish(req, "length")  # (scoring a prompt runs its prefill, then ends)
        elif req.grammar is not None:  # admitted once its grammar is compiled (`step`)
            self.grammar.compiling.append(req)
        else:
            self.planner.waiting.append(req)

    def _admit(self, req: Req) -> None:
        """A request whose grammar is compiled joins the planner's queue (every rank alike)."""
        if self.leader is not None:
            self.leader.admitted(req.uid)
        self.grammar.compiling.remove(req)
        self.planner.waiting.append(req)

    def _admit_compiled(self) -> None:
        """Rank 0, before the step's broadcast (so that the followers do the same at this step):
        admit the requests whose grammar has compiled; end those whose compile failed or ran
        past its deadline (the followers drop them as aborted). Never waits for a compile."""
        ready, failed = self.grammar.poll()
        for req in ready:
            self._admit(req)
        for req, error in failed:
            if self.leader is not None:
                self.leader.aborted(req.uid)
            self._finish(req, "error", error=error)

    def abort(self, uid: int) -> None:
        if self.leader is not None:
            self.leader.aborted(uid)
        req = self.requests.get(uid)
        if req is not None:
            self._finish(req, "abort")

    def warm_up(self) -> None:
        """Serve a few short synthetic requests of varied lengths before the real ones, half
        greedy and half sampled, the second group arriving while the first decodes (prefill,
        mixed and decode steps of several shapes), so that Triton compiles its kernel variants
        now and not in the first user's request (and --enable-torch-compile its graph: a lone
        request ends the warm-up); then forget them: the prefix cache is
        flushed and the reported counters start from zero."""
        vocab, room = self.engine.model_config.vocab_size, self.engine.max_seq_len - 8
        rng = random.Random(0)
        groups = [WARMUP_PROMPT_LENS[::2], WARMUP_PROMPT_LENS[1::2]]
        for group in groups:
            for i, length in enumerate(group):
                ids = [rng.randrange(vocab) for _ in range(max(1, min(length, room)))]
                params = SamplingParams(temperature=0.6 * (i % 2), max_tokens=4, ignore_eos=True)
                self.add_request(self.make_request(ids, params))
            for _ in range(2):
                self.step()
        if self.engine.compiled_decoder is not None:  # a lone decode: its compile happens now
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            self.add_request(self.make_request([rng.randrange(vocab) for _ in range(4)], params))
        while self.has_work:
            self.step()
        self.flush_cache()
        self.planner.reset_counters()

    def flush_cache(self) -> str | None:
        """Empty the prefix cache (SGLang's /flush_cache); why not, while requests run."""
        busy = len(self.planner.admitted()) + len(self.planner.waiting)
        busy += len(self.grammar.compiling)
        if self.has_work or self.cache.prefix_cache.locked_pages:
            return f"cache_busy: {busy} requests are running; flush the cache when idle"
        if self.leader is not None:
            self.leader.flushed()
        self.cache.reset_cache()
        return None

    @property
    def has_work(self) -> bool:
        return self.runnable or bool(self.grammar.compiling)

    @property
    def runnable(self) -> bool:
        """Work for the next step other than waiting for grammars to compile (which only a
        poll of them, not a busy loop, should wait for: scheduler/io.py)."""
        return bool(self.planner.busy or self.pending or self.in_flight)

    def step(self) -> list[TokenOutput]:
        """Launch one forward (if anything can run) and return the tokens that are ready: with
        overlap, those of the previous step, whose device work ran while this one was built."""
        if self.grammar.compiling and not self.follower:
            self._admit_compiled()
        if self.leader is not None:
            self.leader.send()
        if self.in_flight is not None and self.planner.wants_proposals():
            self.pending.extend(self._process(self.in_flight))
            self.in_flight = None
        batch = self.planner.schedule()
        launched = self._launch(batch) if batch is not None else None
        if launched is not None and launched.empty:
            launched = None  # nothing to read back (prompt chunks; requests ended meanwhile)
        ready = [self.in_flight]
        if self.overlap and not (launched is not None and launched.verifies):
            self.in_flight = launched
        else:
            ready.append(launched)
            self.in_flight = None
        outputs, self.pending = self.pending, []
        for step in ready:
            if step is not None:
                outputs.extend(self._process(step))
        return outputs

    def follow(self) -> None:
        """Ranks > 0: replay rank 0's adds, admissions and aborts and step with it, until it
        stops."""
        while isinstance(msg := receive_step(), BatchBackendMsg):
            for change in msg.msgs:
                if isinstance(change, AbortBackendMsg):
                    self.abort(change.uid)
                elif isinstance(change, AdmitBackendMsg):
                    self._admit(self.requests[change.uid])
                elif isinstance(change, FlushCacheMsg):
                    self.cache.reset_cache()  # rank 0 checked that nothing runs
                else:
                    self.add_request(self.make_request(change.input_ids, change.params, change.uid))
            if not (msg.msgs and all(isinstance(c, FlushCacheMsg) for c in msg.msgs)):
                self.step()  # a flush alone is sent outside rank 0's steps

    def stop_followers(self) -> None:
        if self.leader is not None:
            self.leader.send(stop=True)
            self.leader = None

    # ---- one step's phases ---------------------------------------------------------------
    def _launch(self, batch: Batch) -> InFlight:
        """Queue the batch on the device and advance the host state as if it had run: KV now
        covers the computed tokens, and each request that samples gets a placeholder token
        that `_process` fills in (the device already knows it: the next step reads it there)."""
        # a request samples when the step computes its last known token (then its proposals)
        samples = [r.cached_len + r.extend_len - len(r.drafts) == len(r.tokens) for r in batch.reqs]
        forward = self.engine.forward_step(batch, samples)
        if not batch.is_decode:
            now = time.monotonic()
            for req in batch.reqs[batch.num_decodes :]:
                if req.queue_time is None:
                    req.queue_time = now - req.queued_at
        mask: TokenMask | None = None
        if self.grammar.applies(batch):
            # the device runs the forward while the host waits for the step in flight, whose
            # tokens advance the matchers the mask comes from
            if self.in_flight is not None and self.grammar.applies(self.in_flight.batch):
                self.pending.extend(self._process(self.in_flight))
                self.in_flight = None
            mask = self.grammar.mask(batch.reqs, samples)
        output = self.engine.sample_step(batch, forward, mask)
        slots = []
        for i, (req, sampled) in enumerate(zip(batch.reqs, samples)):
            if req.finished:  # by the step in flight, processed above
                slots.append(-1)
                continue
            self.planner.launched(req, batch.is_decode or i < batch.num_decodes, sampled)
            slots.append(len(req.tokens) if sampled else -1)
            if sampled:
                req.tokens.append(PLACEHOLDER)
        return InFlight(batch, slots, output)

    def _process(self, step: InFlight) -> list[TokenOutput]:
        outputs = []
        out, reqs = step.output, step.batch.reqs
        for i, entries in out.prompt_logprobs().items():  # prompt positions this step scored
            reqs[i].prompt_logprobs += entries
        logprobs = out.logprobs() or repeat(None)  # None: no request asked (the usual case)
        verified = out.verified()  # rows with proposals: the target's token at each position
        for i, (req, slot, token, logprob) in enumerate(
            zip(reqs, step.slots, out.tokens(), logprobs)
        ):
            if slot < 0 or req.finished:
                continue  # a prompt chunk that is not the last, or ended meanwhile
            if i in verified:
                outputs += self._accept(req, slot, verified[i])
            else:
                outputs.append(self._output(req, slot, token, logprob))
        return outputs

    def _accept(self, req: Req, slot: int, targets: list[int]) -> list[TokenOutput]:
        """A verified step: the accepted proposals and the target's next token, each output
        as if decoded alone (a stop or the length limit ends the run there). The KV of
        rejected proposals is dropped (cached_len) and overwritten by later tokens."""
        drafts, req.drafts = req.drafts, []
        new = accept(drafts, targets)
        self.planner.backoff.result(req, gained=len(new) > 1)
        req.num_draft_tokens += len(drafts)
        req.num_accepted_tokens += len(new) - 1
        self.planner.num_draft_tokens += len(drafts)
        self.planner.num_accepted_tokens += len(new) - 1
        self.planner.num_verified_rows += 1
        req.cached_len -= len(drafts) - (len(new) - 1)
        self.engine.set_tokens(req.table_idx, new[-1:], start=slot + len(new) - 1)
        del req.tokens[slot:]  # the placeholder
        outputs = []
        for token in new:
            req.tokens.append(PLACEHOLDER)
            outputs.append(self._output(req, len(req.tokens) - 1, token, None))
            if req.finished:
                break
        return outputs

    def _output(self, req: Req, slot: int, token: int, logprob: Entry | None) -> TokenOutput:
        """The request's token at `slot` is known: its output, and its end if it ends it."""
        req.tokens[slot] = token
        reason = self._finish_reason(req, token, slot + 1)
        error = None
        scored = req.params.max_tokens == 0  # a prompt scored: its sampled token is dropped
        if scored:
            reason = "length"
            del req.tokens[slot:]
        elif req.grammar is not None:
            if not req.grammar.accept(token):  # the mask allows only tokens it accepts
                reason, error = "error", f"token {token} does not match the grammar"
            elif reason is None and req.grammar.terminated:
                reason = "stop"
        output = TokenOutput(
            req.uid, None if scored else token, reason is not None, reason, error, logprob
        )
        if slot == req.prompt_len:  # the first output: the prompt's entries go with it
            output.prompt_logprobs = self._prompt_entries(req)
            output.queue_time = req.queue_time
        if reason is not None:
            self._finish(req, reason, report=False, error=error)
        return output

    @staticmethod
    def _prompt_entries(req: Req) -> list[list[Any]] | None:
        if req.params.prompt_logprobs is None:
            return None
        first: list[Any] = [req.tokens[0], None, [], []]  # nothing predicts the first token
        targets = req.tokens[1 : req.prompt_len]
        entries = [[t, *e] for t, e in zip(targets, req.prompt_logprobs)]
        req.prompt_logprobs = []
        return [first, *entries]

    def _finish_reason(self, req: Req, token: int, num_tokens: int) -> str | None:
        eos = token in self.eos_token_ids and not req.params.ignore_eos
        if eos or token in req.params.stop_token_ids:
            return "stop"
        return "length" if reaches_length(req, num_tokens) else None

    def _finish(self, req: Req, reason: str, report: bool = True, error: str | None = None) -> None:
        self.grammar.num_constrained -= req.grammar is not None and req.finish_reason is None
        req.finish_reason, req.error = reason, error  # type: ignore[assignment]
        self.grammar.drop(req)
        self.planner.drop(req)
        while req.tokens and req.tokens[-1] == PLACEHOLDER:
            req.tokens.pop()  # tokens of steps launched past the end
        self.requests.pop(req.uid, None)
        if report:
            self.pending.append(TokenOutput(req.uid, None, True, reason, error))

    def shutdown(self) -> None:
        self.grammar.shutdown()
        if self.planner.proposer is not None:
            self.planner.proposer.shutdown()

    def check_no_leak(self) -> None:
        """Every page is free, owned by the prefix cache, or owned by exactly one admitted request."""
        self.cache.check_invariants(self.planner.owned_pages())
