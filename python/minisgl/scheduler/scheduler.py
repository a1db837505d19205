"""Scheduler: continuous batching over one Engine.

Each step is either a prefill batch (the chunk in progress, then waiting requests, within a
token budget; long prompts are split into chunks) or a decode batch of every running request.
Pages come from the KVCacheManager, which evicts unused prefix-cache pages on demand; when a
decode step still lacks pages, the newest request is preempted: its KV goes to the prefix cache
and it waits to be prefilled again, keeping the tokens it has generated.

Overlap scheduling: `step` launches batch N+1 before it reads batch N's tokens. `_launch`
advances the host state at once (KV covers the computed tokens; a request that samples gets a
PLACEHOLDER token, which the next step reads on the device from the engine's token table) and
`_process` fills the placeholders one step later.

Tensor parallelism: every rank runs a Scheduler over its own Engine shard. Scheduling is
deterministic and sampled tokens are equal on every rank (the logits are all-gathered), so the
ranks stay in step as long as they see the same requests: rank 0 records each add and abort
and broadcasts them at the start of its next step; the others `follow`.

Structured generation (scheduler/grammar.py): a constrained request's next token depends on the
grammar state after its previous one, so a step that may sample one first reads the step in
flight (no overlap for that step); batches without constraints keep full overlap."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from minisgl import env
from minisgl.core import Batch, Req, SamplingParams
from minisgl.distributed import broadcast_object, get_tp_info
from minisgl.engine import Engine
from minisgl.engine.engine import StepOutput
from minisgl.engine.sample import TokenMask
from minisgl.kvcache import KVCacheManager
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    MaskBuilder,
    grammar_key,
)


@dataclass
class TokenOutput:
    uid: int
    token: int | None  # None when the request ends without a new token (abort, max_tokens=0)
    finished: bool
    finish_reason: str | None = None
    error: str | None = None  # with finish_reason "error"


PLACEHOLDER = -1  # a sampled token id the host has not read yet


@dataclass
class InFlight:
    """A launched step: its batch, where each sampled token goes in its request's tokens
    (-1: none), and the device-to-host copy of the sampled ids."""

    batch: Batch
    slots: list[int]
    output: StepOutput


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
        self.page_size = engine.page_size
        self.cache = KVCacheManager(engine.num_pages, engine.page_size, config.cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # fully prefilled, in admission order (newest last)
        self.prefilling: Req | None = None  # the request whose prompt is half-way through chunks
        self.free_rows = list(range(engine.config.max_running_requests - 1, -1, -1))
        self.requests: dict[int, Req] = {}
        self.pending: list[TokenOutput] = []  # results produced outside a forward (abort, ...)
        self.num_preemptions = 0
        self.overlap = not env.disable_overlap_scheduling()
        self.in_flight: InFlight | None = None  # launched step whose tokens are not read yet
        self.num_prefill_tokens = 0  # prompt tokens scheduled (for the prefix-cache hit rate)
        self.num_cached_tokens = 0  # of those, found in the prefix cache
        tp = get_tp_info()
        self.solo = tp.size == 1
        self.leads = tp.size > 1 and tp.is_primary  # rank 0 of several: tells the others
        self.changes: list[tuple] = []  # adds and aborts the other ranks have not seen yet
        self.tokenizer = tokenizer  # for grammars; built on the first constrained request:
        self.grammars: GrammarCompiler | None = None
        self.masks: MaskBuilder | None = None
        self.num_constrained = 0  # admitted requests with a grammar: 0 skips every grammar check

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
            pool = self.engine.num_pages * self.page_size
            where = (
                f"the KV cache ({pool} tokens)"
                if pool < self.engine.max_model_len
                else "the context"
            )
            raise ValueError(
                f"prompt of {len(input_ids)} tokens is longer than {where}: at most {limit - 1} allowed"
            )
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        total = min(limit, len(input_ids) + params.max_tokens)
        req = Req(list(input_ids), len(input_ids), params, max_total_len=total)
        if uid is not None:
            req.uid = uid
        key = grammar_key(params)
        if key is not None:  # compiles on a worker thread from now on
            req.grammar = Constraint(self._grammar_compiler().compile(key))
        return req

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            vocab = self.engine.model_config.vocab_size
            stops = sorted(self.eos_token_ids)
            self.grammars = GrammarCompiler(self.tokenizer, vocab, stops)
        return self.grammars

    def add_request(self, req: Req) -> None:
        if self.leads:  # the seed too: one drawn at random must be the same on every rank
            prompt = req.tokens[: req.prompt_len]
            self.changes.append(("add", req.uid, prompt, req.params, req.seed))
        self.requests[req.uid] = req
        self.num_constrained += req.grammar is not None
        if req.params.max_tokens == 0:
            self._finish(req, "length")
        else:
            self.waiting.append(req)

    def abort(self, uid: int) -> None:
        if self.leads:
            self.changes.append(("abort", uid))
        req = self.requests.get(uid)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self.prefilling or self.pending or self.in_flight
        )

    def step(self) -> list[TokenOutput]:
        """Launch one forward (if anything can run) and return the tokens that are ready: with
        overlap, those of the previous step, whose device work ran while this one was built."""
        if self.leads:
            broadcast_object((self.changes, False))
            self.changes = []
        batch = self._schedule_prefill() or self._schedule_decode()
        launched = self._launch(batch) if batch is not None else None
        if launched is not None and all(slot < 0 for slot in launched.slots):
            launched = None  # nothing to read back (prompt chunks; requests ended meanwhile)
        if self.overlap:
            ready, self.in_flight = self.in_flight, launched
        else:
            ready = launched
        outputs, self.pending = self.pending, []
        if ready is not None:
            outputs.extend(self._process(ready))
        return outputs

    def follow(self) -> None:
        """Ranks > 0: replay rank 0's adds and aborts and step with it, until it stops."""
        while True:
            changes, stop = broadcast_object(None)
            if stop:
                return
            for change in changes:
                if change[0] == "abort":
                    self.abort(change[1])
                    continue
                _, uid, prompt, params, seed = change
                req = self.make_request(prompt, params, uid=uid)
                req.seed = seed
                self.add_request(req)
            self.step()

    def stop_followers(self) -> None:
        if self.leads:
            broadcast_object(([], True))
            self.leads = False

    # ---- scheduling ----------------------------------------------------------------------
    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.max_prefill_tokens
        reserve = len(self.running)  # leave a page per decoding request for its next token
        reqs: list[Req] = []
        if self.prefilling is not None:
            req = self.prefilling
            n = self._fit(req, min(req.remaining_len, budget), reserve)
            if n == 0:
                return None
            self.prefilling = req if n < req.remaining_len else None
            reqs.append(req)
            budget -= n
        while budget > 0 and self.prefilling is None and self.waiting and self.free_rows:
            req = self.waiting[0]
            # refused before any work is spent on it; with TP, whether the compile is done yet
            # differs between ranks, so they learn it at launch, where every rank waits for it
            failure = req.grammar.failure() if req.grammar is not None and self.solo else None
            if failure is not None:
                self._finish(req, "error", error=failure)
                continue
            self._admit(req)
            n = self._fit(req, min(req.remaining_len, budget), reserve)
            if n == 0:
                self._release(req)
                break
            self.waiting.popleft()
            self.num_prefill_tokens += len(req.tokens)
            self.num_cached_tokens += req.cached_len
            self.prefilling = req if n < req.remaining_len else None
            reqs.append(req)
            budget -= n
        return Batch(reqs, "prefill") if reqs else None

    def _schedule_decode(self) -> Batch | None:
        i, reqs = 0, []
        while i < len(self.running):
            req = self.running[i]
            if self._reaches_length(req, len(req.tokens)):
                i += 1  # its last token is still in flight and ends it
                continue
            if self._grow(req, 1):
                req.extend_len = 1
                reqs.append(req)
                i += 1
                continue
            victim = self.prefilling or self.running[-1]
            self._preempt(victim)  # if the victim is `req` itself, index i now holds the next one
            if victim in reqs:
                reqs.remove(victim)
        return Batch(reqs, "decode") if reqs else None

    def _admit(self, req: Req) -> None:
        """Give the request a page-table row and lock its longest cached prefix. The last prompt
        token is never matched: its logits are needed to sample."""
        req.table_idx = self.free_rows.pop()
        handle, pages = self.cache.match_and_lock(req.tokens[: len(req.tokens) - 1])
        req.cache_handle, req.pages, req.cached_len = handle, list(pages), handle.length
        self.engine.set_pages(req.table_idx, 0, req.pages)
        self.engine.set_tokens(req.table_idx, req.tokens)

    def _fit(self, req: Req, want: int, reserve: int) -> int:
        """Grow `req` for up to `want` more tokens within the free pages (minus `reserve`);
        returns the number of tokens it can compute (0 if none), with extend_len set."""
        spare = max(0, self.cache.available_pages() - reserve)
        room = (len(req.pages) + spare) * self.page_size - req.cached_len
        n = max(0, min(want, room))
        if n > 0 and not self._grow(req, n):
            n = 0
        req.extend_len = n
        return n

    def _grow(self, req: Req, num_tokens: int) -> bool:
        """Make sure the request's pages cover `num_tokens` tokens past cached_len."""
        need = -(-(req.cached_len + num_tokens) // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.cache.allocate(need)
        if pages is None:
            return False
        self.engine.set_pages(req.table_idx, len(req.pages), pages)
        req.pages.extend(pages)
        return True

    # ---- results -------------------------------------------------------------------------
    def _launch(self, batch: Batch) -> InFlight:
        """Queue the batch on the device and advance the host state as if it had run: KV now
        covers the computed tokens, and each request that samples gets a placeholder token
        that `_process` fills in (the device already knows it: the next step reads it there)."""
        samples = [r.cached_len + r.extend_len == len(r.tokens) for r in batch.reqs]
        failed: list[tuple[Req, str]] = []
        forward = self.engine.forward_step(batch, samples)
        mask = None
        if self.num_constrained and _constrained(batch):
            # the device runs the forward while the host waits for grammars still compiling
            # and for the step in flight, whose tokens advance the matchers the mask comes from
            if self.in_flight is not None and _constrained(self.in_flight.batch):
                self.pending.extend(self._process(self.in_flight))
                self.in_flight = None
            mask = self._grammar_mask(batch.reqs, samples, failed)
        output = self.engine.sample_step(batch, forward, mask)
        slots = []
        for req, sampled in zip(batch.reqs, samples):
            if req.finished:  # by the step in flight, processed in grammar_mask
                slots.append(-1)
                continue
            req.cached_len += req.extend_len
            req.extend_len = 0
            if batch.phase == "prefill":
                self._share(req)
            slots.append(len(req.tokens) if sampled else -1)
            if sampled:
                req.tokens.append(PLACEHOLDER)
                if batch.phase == "prefill":  # prefill requests never come from `running`
                    self.running.append(req)
        for req, error in failed:  # its sampled token is dropped by _process
            self._finish(req, "error", error=error)
        return InFlight(batch, slots, output)

    def _grammar_mask(
        self, reqs: list[Req], samples: list[bool], failed: list[tuple[Req, str]]
    ) -> TokenMask | None:
        """The token bitmask of the requests that sample under a grammar, and their rows."""
        matchers, rows = [], []
        for i, (req, sampled) in enumerate(zip(reqs, samples)):
            if not sampled or req.grammar is None or req.finished:
                continue
            try:
                matchers.append(req.grammar.wait())
            except GrammarError as e:
                failed.append((req, str(e)))
                continue
            rows.append(i)
        if not rows:
            return None
        if self.masks is None:
            engine = self.engine
            rows_max, vocab = engine.config.max_running_requests, engine.model_config.vocab_size
            self.masks = MaskBuilder(rows_max, vocab, pin=engine.device.type == "cuda")
        return TokenMask(self.masks.fill(matchers, rows, len(reqs)), rows)

    def _share(self, req: Req) -> None:
        """Put the request's computed KV into the prefix cache now, not only when it ends, so
        that requests admitted later with the same prefix (a shared system prompt, the rest of
        a long prompt's chunks) reuse it. Safe right after the launch: any reader is queued
        behind the writer on the same stream. Pages the cache already had replace the
        request's duplicates, so its page-table row is rewritten."""
        old = req.pages
        req.cache_handle, req.pages = self.cache.cache_prefix(
            req.tokens[: req.cached_len], old, req.cache_handle
        )
        if req.pages != old:
            self.engine.set_pages(req.table_idx, 0, req.pages)

    def _process(self, step: InFlight) -> list[TokenOutput]:
        outputs = []
        for req, slot, token in zip(step.batch.reqs, step.slots, step.output.tokens()):
            if slot < 0 or req.finished:
                continue  # a prompt chunk that is not the last, or ended meanwhile
            req.tokens[slot] = token
            reason = self._finish_reason(req, token, slot + 1)
            error = None
            if req.grammar is not None:
                if not req.grammar.accept(token):  # the mask allows only tokens it accepts
                    reason, error = "error", f"token {token} does not match the grammar"
                elif reason is None and req.grammar.terminated:
                    reason = "stop"
            outputs.append(TokenOutput(req.uid, token, reason is not None, reason, error))
            if reason is not None:
                self._finish(req, reason, report=False, error=error)
        return outputs

    def _reaches_length(self, req: Req, num_tokens: int) -> bool:
        num_output = num_tokens - req.prompt_len
        return num_output >= req.params.max_tokens or num_tokens >= req.max_total_len

    def _finish_reason(self, req: Req, token: int, num_tokens: int) -> str | None:
        params = req.params
        if (
            token in self.eos_token_ids and not params.ignore_eos
        ) or token in params.stop_token_ids:
            return "stop"
        return "length" if self._reaches_length(req, num_tokens) else None

    def _finish(self, req: Req, reason: str, report: bool = True, error: str | None = None) -> None:
        self.num_constrained -= req.grammar is not None and req.finish_reason is None
        req.finish_reason, req.error = reason, error  # type: ignore[assignment]
        self._release(req)
        if req in self.waiting:  # preempted while its last step was in flight
            self.waiting.remove(req)
        while req.tokens and req.tokens[-1] == PLACEHOLDER:
            req.tokens.pop()  # tokens of steps launched past the end
        self.requests.pop(req.uid, None)
        if report:
            self.pending.append(TokenOutput(req.uid, None, True, reason, error))

    def _preempt(self, req: Req) -> None:
        self._release(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        """Return the request's pages (its computed KV goes to the prefix cache) and its row."""
        if req.table_idx < 0:
            return
        self.cache.release(req.tokens[: req.cached_len], req.pages, req.cache_handle)
        self.free_rows.append(req.table_idx)
        req.table_idx, req.pages, req.cache_handle = -1, [], None
        req.cached_len = req.extend_len = 0
        if req in self.running:
            self.running.remove(req)
        if self.prefilling is req:
            self.prefilling = None

    def shutdown(self) -> None:
        if self.grammars is not None:
            self.grammars.shutdown()

    def check_no_leak(self) -> None:
        """Every page is free, owned by the prefix cache, or owned by exactly one admitted request."""
        admitted = self.running + ([self.prefilling] if self.prefilling else [])
        # a request's first pages came from the prefix cache, which still owns them
        owned = [p for r in admitted for p in r.pages[r.cache_handle.length // self.page_size :]]
        self.cache.check_invariants(owned)


def _constrained(batch: Batch) -> bool:
    return any(r.grammar is not None for r in batch.reqs)
