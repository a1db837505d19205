"""Speculative decoding's proposers: which tokens a running request proposes for the next step.
`NgramProposer` (prompt lookup) searches the request's own tokens; `DraftModelProposer` runs a
smaller model with the target's vocabulary as an Engine of its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from minisgl.context import Context, get_global_ctx, set_global_ctx
from minisgl.core import Batch, Req
from minisgl.engine import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.ext.perf.prefill_rows import samples_plainly
from minisgl.ext.spec.options import DRAFT_OPTION, spec_options
from minisgl.ext.spec.verify import VerifyRows
from minisgl.kvcache.allocator import PageAllocator
from minisgl.models.config import ModelConfig
from minisgl.models.hf import load_hf_config
from minisgl.models.weight import resolve_model_path
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.options import OptionError

NGRAM_WINDOW = 4096  # the latest tokens of a request searched for a match


def room(req: Req, num_draft: int) -> int:
    """How many tokens `req` may propose: never past its max_tokens or context (the step's own
    sampled token comes after them); 0 for a request that decodes without proposals."""
    if not samples_plainly(req):
        return 0
    left = req.params.max_tokens - req.num_output - 1
    return max(0, min(num_draft, left, req.max_total_len - len(req.tokens) - 1))


class NgramProposer:
    """Prompt lookup: for n from `max_n` down to `min_n`, the latest earlier occurrence of the
    request's last n tokens within its last NGRAM_WINDOW tokens; the tokens that followed it
    are the proposal (up to `num_draft`). Each request's tokens are kept as a string, one
    character per id, extended by the new tokens at each lookup, so that the search is
    str.rfind's (C) rather than a Python loop over the window (0.39 ms a lookup of a 4,096-token
    window that matches nothing, ~0.01 ms this way)."""

    def __init__(self, num_draft: int, min_n: int, max_n: int) -> None:
        self.num_draft, self.min_n, self.max_n = num_draft, min_n, max_n
        self.texts: dict[int, str] = {}  # uid -> its tokens so far, chr(id) each

    def propose_all(self, reqs: list[Req]) -> dict[int, list[int]]:
        """uid -> proposals for the tokens after req.tokens (requests without any absent)."""
        out = {}
        for req in reqs:
            if drafts := self.propose(req):
                out[req.uid] = drafts
        return out

    def propose(self, req: Req) -> list[int]:
        limit = room(req, self.num_draft)
        if limit == 0:
            return []
        text = self._text(req)
        start = max(0, len(text) - NGRAM_WINDOW)
        for n in range(min(self.max_n, len(text) - start - 1), self.min_n - 1, -1):
            found = latest_match(text, n, start)
            if found is not None:
                return req.tokens[found : found + limit]
        return []

    def _text(self, req: Req) -> str:
        """req.tokens as a string. Tokens only grow while a request runs (a lookup never sees
        the placeholder of a step in flight), so the kept string is extended; a spot check of
        its last id rebuilds it should that ever not hold."""
        text, tokens = self.texts.get(req.uid, ""), req.tokens
        if len(text) > len(tokens) or (text and ord(text[-1]) != tokens[len(text) - 1]):
            text = ""
        text += "".join(map(chr, tokens[len(text) :]))  # ids are below chr's 0x110000
        self.texts[req.uid] = text
        return text

    def release(self, req: Req) -> None:
        """The request left the running set."""
        self.texts.pop(req.uid, None)

    def shutdown(self) -> None:
        pass


def latest_match(text: str, n: int, start: int = 0) -> int | None:
    """The end of the latest occurrence of text[-n:] at or after `start` that ends before the
    last token (so a continuation exists), or None. `text`: token ids, one character each."""
    pos = text.rfind(text[-n:], start, len(text) - 1)
    return None if pos < 0 else pos + n


@contextmanager
def using_context(ctx: Context) -> Iterator[None]:
    """Run another engine's forward: the layers find its KV pool and backend globally."""
    previous = get_global_ctx()
    set_global_ctx(ctx)
    try:
        yield
    finally:
        set_global_ctx(previous)


@dataclass
class DraftState:
    """One request in the draft model's own KV pool: its pages, and the input token at each
    position the draft has computed (its KV is valid while those equal the request's tokens)."""

    pages: list[int] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)
    checked: int = 0  # positions known to equal the request's tokens


class DraftModelProposer:
    """A smaller model with the target's vocabulary proposes by decoding `num_draft` tokens
    (SGLang's `standalone`). It runs as its own Engine (weights, KV pool with the target's
    page count, page table by the same rows, CUDA graphs), one batched extend per step to catch
    up with each request's new tokens, then num_draft - 1 decode steps. It samples each
    position with the request's seed and temperature, as the target does there, so whenever
    the two models agree on a distribution their draws coincide."""

    def __init__(self, target: Engine, num_draft: int, path: str) -> None:
        self.num_draft = num_draft
        # a fixed pool size applies to both; else the draft sizes its pool from the memory the
        # target left it (leave_room_for_draft)
        pages = None if target.config.num_pages is None else target.num_pages
        path = resolve_model_path(path, DRAFT_OPTION)
        config = dataclasses.replace(target.config, model=path, num_pages=pages)
        previous = get_global_ctx()
        try:
            self.engine = Engine(config)
        finally:
            set_global_ctx(previous)
        vocab, want = self.engine.model_config.vocab_size, target.model_config.vocab_size
        if vocab != want:
            message = f"the draft model's vocabulary has {vocab} tokens, the target's {want}"
            raise OptionError(DRAFT_OPTION, message)
        # a catch-up of running requests replays the graphs as one row per position
        self.engine.forward_paths = [VerifyRows(eager=False)]
        self.allocator = PageAllocator(self.engine.num_pages)
        self.states: dict[int, DraftState] = {}

    def propose_all(self, reqs: list[Req]) -> dict[int, list[int]]:
        wanted = {r.uid: n for r in reqs if (n := room(r, self.num_draft)) and self._prepare(r, n)}
        shadows = [self._shadow(r) for r in reqs if r.uid in wanted]
        if not shadows:
            return {}
        starts = {s.uid: len(s.tokens) for s in shadows}
        with using_context(self.engine.ctx):
            # catch up with each request's new tokens (running requests: with CUDA graphs a
            # short catch-up runs as decode rows, VerifyRows)
            batch = Batch(shadows, "prefill", num_decodes=len(shadows))
            while batch.reqs:
                out = self.engine.forward(batch, [True] * batch.size)
                for shadow, token in zip(batch.reqs, self.engine.sample(batch, out).tokens()):
                    shadow.cached_len += shadow.extend_len
                    shadow.extend_len = 1
                    shadow.tokens.append(token)
                more = [s for s in batch.reqs if len(s.tokens) - starts[s.uid] < wanted[s.uid]]
                batch = Batch(more, "decode")
        for shadow in shadows:
            self.states[shadow.uid].seen = shadow.tokens[: shadow.cached_len]
        return {s.uid: s.tokens[starts[s.uid] :] for s in shadows}

    def _prepare(self, req: Req, num_draft: int) -> bool:
        """Drop the draft KV whose inputs differ from the request's tokens (rejected
        proposals), then make its pages cover the catch-up and num_draft - 1 decodes."""
        state = self.states.setdefault(req.uid, DraftState())
        n, seen = state.checked, state.seen
        limit = min(len(seen), len(req.tokens))
        while n < limit and seen[n] == req.tokens[n]:
            n += 1
        del seen[n:]
        state.checked = n
        size = self.engine.page_size
        need = -(-(len(req.tokens) + num_draft - 1) // size) - len(state.pages)
        if need > 0:
            pages = self.allocator.alloc(need)
            if pages is None:
                return False
            self.engine.set_pages(req.table_idx, len(state.pages), pages)
            state.pages += pages
        self.engine.set_tokens(req.table_idx, req.tokens[n:], start=n)
        return True

    def _shadow(self, req: Req) -> Req:
        """The request as the draft engine sees it: the same row, seed and sampling, its own
        computed length (a copy of the tokens, which the draft extends)."""
        state = self.states[req.uid]
        shadow = Req(list(req.tokens), req.prompt_len, req.params, req.max_total_len, req.uid)
        shadow.seed, shadow.table_idx = req.seed, req.table_idx
        shadow.cached_len = len(state.seen)
        shadow.extend_len = len(req.tokens) - shadow.cached_len
        return shadow

    def release(self, req: Req) -> None:
        state = self.states.pop(req.uid, None)
        if state is not None:
            self.allocator.free(state.pages)

    def shutdown(self) -> None:
        with using_context(self.engine.ctx):
            self.engine.shutdown()


def kv_per_token(model: str, option: str = "model") -> int:
    """A model's KV elements per token (layers x KV heads x head dim), from its config; `option`
    names the model's flag in an error."""
    cfg = ModelConfig.from_hf(load_hf_config(resolve_model_path(model, option)))
    return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim


def leave_room_for_draft(config: EngineConfig, sched: SchedulerConfig) -> EngineConfig:
    """With a draft model on the GPU, the target's KV pool takes only its share of the free
    memory, by the two models' KV bytes per token, so that the draft's pool (sized later from
    what is left) holds about as many tokens; without this the target takes it all and the
    draft's pool does not fit."""
    options = spec_options(sched)
    path = options.speculative_draft_model_path
    if options.speculative_algorithm != "standalone" or config.num_pages:
        return config
    assert path is not None and config.model is not None  # SchedulerConfig, LLM and CLI set them
    target, draft = kv_per_token(config.model), kv_per_token(path, DRAFT_OPTION)
    return dataclasses.replace(config, memory_ratio=config.memory_ratio * target / (target + draft))
