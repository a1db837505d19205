"""BatchPlanner: which requests the next forward computes (every running decode, plus prompt
chunks within a token budget), the pages they compute into, and preemption."""

from __future__ import annotations

import time

from minisgl.core import Batch, Req
from minisgl.engine.engine import Engine
from minisgl.extension import Speculator, StepFeature
from minisgl.kvcache.manager import KVCacheManager
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.queue import make_queue

STEP_TOKENS = 8192  # a step's budgets unless given or an extension's (SGLang's on an H100, H200)


def reaches_length(req: Req, num_tokens: int) -> bool:
    """Whether `num_tokens` tokens end the request by max_tokens or by its context."""
    num_output = num_tokens - req.prompt_len
    return num_output >= req.params.max_tokens or num_tokens >= req.max_total_len


def decode_batch(reqs: list[Req]) -> Batch | None:
    """A step of running requests only: a decode, or an extend when some verify proposals."""
    if not reqs:
        return None
    if any(r.extend_len > 1 for r in reqs):
        return Batch(reqs, "prefill", num_decodes=len(reqs))
    return Batch(reqs, "decode")


class BatchPlanner:
    def __init__(self, engine: Engine, cache: KVCacheManager, config: SchedulerConfig) -> None:
        self.engine, self.cache, self.page_size = engine, cache, engine.page_size
        self.features: list[StepFeature] = []  # the scheduler's (admission hooks)
        self.max_prefill_tokens = config.max_prefill_tokens or STEP_TOKENS
        self.max_batched_tokens = config.max_num_batched_tokens or STEP_TOKENS
        self.mixed = not config.disable_mixed_steps
        self.waiting = make_queue(config, cache)  # its order and who gives way to whom
        self.spec: Speculator | None = None  # the scheduler's speculative decoding
        self.running: list[Req] = []  # fully prefilled, in admission order (newest last)
        self.prefilling: Req | None = None  # the request whose prompt is half-way through chunks
        self.free_rows = list(range(engine.config.max_running_requests - 1, -1, -1))
        # the totals the server reports (/metrics, /stats; zeroed after ext/serving's warm-up)
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens scheduled (for the prefix-cache hit rate)
        self.num_cached_tokens = 0  # of those, found in the prefix cache

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def schedule(self) -> Batch | None:
        """Every running request's next token, then prompt chunks in what is left of the budget."""
        if not self.mixed or not self.running:
            budget = self._budget(self.max_prefill_tokens, [], 0)
            return self._schedule_prefill(budget) or decode_batch(self._schedule_decode())
        decodes = self._schedule_decode()
        num_decode_tokens = sum(r.extend_len for r in decodes)  # proposals count too
        budget = min(self.max_prefill_tokens, self.max_batched_tokens - num_decode_tokens)
        budget = self._budget(budget, decodes, num_decode_tokens)
        prefill = self._schedule_prefill(budget) if budget > 0 else None
        decodes = [r for r in decodes if r.table_idx >= 0]  # not preempted for a prompt
        if prefill is None:
            return decode_batch(decodes)
        return Batch(decodes + prefill.reqs, "prefill", num_decodes=len(decodes))

    def _budget(self, budget: int, decodes: list[Req], num_decode_tokens: int) -> int:
        for path in self.engine.forward_paths:  # the speed paths' prompt budgets
            budget = path.prefill_budget(self, budget, decodes, num_decode_tokens)
        return budget

    def _schedule_prefill(self, budget: int) -> Batch | None:
        reserve = len(self.running)  # leave a page per decoding request for its next token
        reqs: list[Req] = []
        if self.prefilling is not None:
            req = self.prefilling
            while (n := self._fit(req, min(req.remaining_len, budget), reserve)) == 0:
                if not self._preempt_for(req):
                    return None
                reserve = len(self.running)
            self.prefilling = req if n < req.remaining_len else None
            reqs.append(req)
            budget -= n
        while budget > 0 and self.prefilling is None and (new := self.waiting.first()):
            n = self._admit_chunk(new, budget, reserve)
            if n == 0:
                break
            self.prefilling = new if n < new.remaining_len else None
            reqs.append(new)
            budget -= n
        return Batch(reqs, "prefill") if reqs else None

    def _admit_chunk(self, req: Req, budget: int, reserve: int) -> int:
        """Admit the waiting `req` with its first chunk: tokens it computes (0: it waits)."""
        while True:
            if self.free_rows:
                self.admit(req)
                if (n := self._fit(req, min(req.remaining_len, budget), reserve)) > 0:
                    break
                self.release(req)
            if not self._preempt_for(req):
                return 0
            reserve = len(self.running)
        self.waiting.remove(req)
        self.num_prefill_tokens += len(req.tokens)
        self.num_cached_tokens += req.cached_len
        if req.queue_time is None:  # its first admission: the cache supplied cached_len
            req.queue_time, req.cached_tokens = time.monotonic() - req.queued_at, req.cached_len
        return n

    def _preempt_for(self, req: Req) -> bool:
        """Preempt the running request the queue's policy lets `req` preempt (fcfs: none)."""
        victim = self.waiting.victim_for(req, self.running)
        if victim is not None:
            self._preempt(victim)
        return victim is not None

    def _schedule_decode(self) -> list[Req]:  # the running requests that decode in the step
        i, reqs = 0, []
        while i < len(self.running):
            req = self.running[i]
            if reaches_length(req, len(req.tokens)):
                i += 1  # its last token is still in flight and ends it
                continue
            if self.grow(req, 1):
                req.extend_len = 1
                reqs.append(req)
                i += 1
                continue
            victim = self.waiting.decode_victim(self.running, self.prefilling)
            self._preempt(victim)  # if the victim is `req` itself, index i now holds the next one
            if victim in reqs:
                reqs.remove(victim)
        if self.spec is not None:  # proposals past their next tokens, where pages are left
            self.spec.propose(self, reqs)
        return reqs

    def admit(self, req: Req) -> None:
        """A page-table row and the longest cached prefix, locked."""
        # the prefix never takes the last prompt token: its logits are needed
        req.table_idx = self.free_rows.pop()
        limits = [f.prefix_limit(req) for f in self.features if f.name in req.ext]
        matched = min([len(req.tokens) - 1, *limits])
        handle, pages = self.cache.match_and_lock(self._cache_key(req, matched))
        req.cache_handle, req.pages, req.cached_len = handle, list(pages), handle.length
        self.engine.set_pages(req.table_idx, 0, req.pages)
        self.engine.set_tokens(req.table_idx, req.tokens)
        for f in self.features:  # every request: a row's previous state is theirs to clear
            f.admitted(req)

    def _cache_key(self, req: Req, n: int) -> list[int]:
        """The request's first `n` tokens as the prefix cache keys them."""
        # under a feature's namespace (a LoRA adapter's) the first becomes a negative id that no
        # token has, so KV is shared only within the namespace (SGLang's extra_key)
        key = req.tokens[:n]
        for f in self.features:
            if key and f.name in req.ext and (space := f.cache_namespace(req)):
                key[0] = -1 - (req.tokens[0] | space << 32)  # token ids are < 2**31
        return key

    def _fit(self, req: Req, want: int, reserve: int) -> int:
        """Grow `req` for up to `want` tokens within the free pages less `reserve` -> extend_len."""
        spare = max(0, self.cache.available_pages() - reserve)
        room = (len(req.pages) + spare) * self.page_size - req.cached_len
        n = max(0, min(want, room))
        if n > 0 and not self.grow(req, n):
            n = 0
        req.extend_len = n
        return n

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Pages for `num_tokens` tokens past cached_len (False: not enough free)."""
        need = -(-(req.cached_len + num_tokens) // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.cache.allocate(need)
        if pages is None:
            return False
        self.engine.set_pages(req.table_idx, len(req.pages), pages)
        req.pages.extend(pages)
        return True

    def launched(self, req: Req, decode_row: bool, samples: bool) -> None:
        """Its forward is queued: KV covers the computed tokens; a last chunk joins `running`."""
        req.cached_len += req.extend_len
        req.extend_len = 0
        if not decode_row:
            self._share(req)
            if samples:  # prefill requests never come from `running`
                self.running.append(req)

    def _share(self, req: Req) -> None:
        """The computed KV into the prefix cache now, so that later requests reuse it."""
        # safe after the launch: readers queue behind the writer; duplicates become the cache's
        old = req.pages
        assert req.cache_handle is not None, "an admitted request holds its prefix-cache lock"
        req.cache_handle, req.pages = self.cache.cache_prefix(
            self._cache_key(req, req.cached_len), old, req.cache_handle
        )
        if req.pages != old:
            self.engine.set_pages(req.table_idx, 0, req.pages)

    def _preempt(self, req: Req) -> None:
        """Its KV goes to the prefix cache; it is prefilled again later, generated tokens kept."""
        self.release(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def drop(self, req: Req) -> None:
        """The request has ended: out of the queues, its pages and row released."""
        self.release(req)
        if req in self.waiting:  # preempted while its last step was in flight
            self.waiting.remove(req)

    def release(self, req: Req) -> None:
        """Return the request's pages (its computed KV goes to the prefix cache) and its row."""
        if req.table_idx < 0:
            return
        assert req.cache_handle is not None, "an admitted request holds its prefix-cache lock"
        self.cache.release(self._cache_key(req, req.cached_len), req.pages, req.cache_handle)
        self.free_rows.append(req.table_idx)
        if self.spec is not None:
            self.spec.release(req)
        req.table_idx, req.pages, req.cache_handle = -1, [], None
        req.cached_len = req.extend_len = 0
        if req in self.running:
            self.running.remove(req)
        if self.prefilling is req:
            self.prefilling = None

    def admitted(self) -> list[Req]:
        return self.running + ([self.prefilling] if self.prefilling else [])

    def owned_pages(self) -> list[int]:  # the admitted requests' (not the prefix cache's)
        owned = []
        for req in self.admitted():
            assert req.cache_handle is not None
            owned += req.pages[req.cache_handle.length // self.page_size :]
        return owned
