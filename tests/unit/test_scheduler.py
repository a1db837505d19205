"""The Scheduler on a fake engine (no model): which batches it builds, in which order, with which
pages, and which tokens come out of which step. The fake forward records each batch and checks
what a real one would read (page-table rows, known input tokens); sampled tokens come from a
script of (uid, position)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.message import BatchBackendMsg, ExitMsg, decode
from minisgl.scheduler import Scheduler, SchedulerConfig, TokenOutput
from minisgl.scheduler import tp as tp_mod
from minisgl.scheduler.scheduler import PLACEHOLDER

EOS = 2
PAGE = 4


def script(uid: int, pos: int) -> int:
    """The token a request samples at `pos`: differs by request and position, never EOS."""
    return 10 + (7 * uid + 3 * pos) % 900


class FakeStep:
    prompt = None  # no prompt log-probabilities

    def __init__(self, engine: FakeEngine, index: int, tokens: list[int]) -> None:
        self.engine, self.index, self._tokens = engine, index, tokens

    def tokens(self) -> list[int]:
        self.engine.log.append(("read", self.index))
        return self._tokens

    def logprobs(self) -> None:
        return None

    def prompt_logprobs(self) -> dict:
        return {}


class FakeEngine:
    """The part of Engine the scheduler uses: sizes, page-table and token-table writes, and the
    two phases of a step."""

    def __init__(self, num_pages: int = 64, max_running_requests: int = 8) -> None:
        self.page_size, self.num_pages = PAGE, num_pages
        self.max_model_len = 1024
        self.max_seq_len = min(self.max_model_len, num_pages * PAGE)
        self.model_config = SimpleNamespace(vocab_size=1000)
        self.config = SimpleNamespace(max_running_requests=max_running_requests)
        self.device = torch.device("cpu")
        self.page_table: dict[int, list[int]] = {}
        self.token_table: dict[int, dict[int, int]] = {}
        self.batches: list[tuple[str, list[tuple[int, int]]]] = []  # (phase, [(uid, extend)])
        self.log: list[tuple[str, int]] = []  # ("forward", i) and ("read", i), in order

    def set_pages(self, row: int, start: int, pages: list[int]) -> None:
        table = self.page_table.setdefault(row, [])
        assert start <= len(table), "a hole in the page-table row"
        table[start : start + len(pages)] = pages

    def set_tokens(self, row: int, tokens: list[int]) -> None:
        self.token_table[row] = dict(enumerate(tokens))

    def forward_step(self, batch: Batch, samples: list[bool]) -> list[tuple[int, int] | None]:
        rows = [r.table_idx for r in batch.reqs]
        assert len(set(rows)) == len(rows) and min(rows) >= 0
        for req in batch.reqs:
            end = req.cached_len + req.extend_len
            assert req.extend_len > 0 and len(req.pages) * PAGE >= end
            assert self.page_table[req.table_idx][: len(req.pages)] == req.pages
            known = self.token_table[req.table_idx]
            for pos in range(req.cached_len, end):  # the inputs the device would gather
                assert known.get(pos, PLACEHOLDER) != PLACEHOLDER, (req.uid, pos)
                assert req.tokens[pos] in (known[pos], PLACEHOLDER)
        self.batches.append((batch.phase, [(r.uid, r.extend_len) for r in batch.reqs]))
        self.log.append(("forward", len(self.batches)))
        ends = [(r.table_idx, r.cached_len + r.extend_len) for r in batch.reqs]
        return [end if sampled else None for end, sampled in zip(ends, samples)]

    def track_adjustments(self, req: Req, eos_token_ids: object) -> None:
        pass

    def sample_step(self, batch: Batch, forward: list, mask: object = None) -> FakeStep:
        assert mask is None
        tokens = []
        for req, end in zip(batch.reqs, forward):
            token = script(req.uid, req.cached_len + req.extend_len)
            if end is not None:
                self.token_table[end[0]][end[1]] = token
            tokens.append(token)
        return FakeStep(self, len(self.batches), tokens)


@pytest.fixture
def make(monkeypatch):
    """make(overlap, max_prefill_tokens, **engine) -> a Scheduler on a FakeEngine; when the
    test ends, each one runs to the end and must have every page free or in the prefix cache."""
    made: list[Scheduler] = []

    def build(overlap: bool = True, max_prefill_tokens: int = 8192, **engine: int) -> Scheduler:
        monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
        config = SchedulerConfig(max_prefill_tokens=max_prefill_tokens)
        made.append(Scheduler(FakeEngine(**engine), config, {EOS}))
        return made[-1]

    yield build
    for sched in made:
        run(sched)
        sched.check_no_leak()
        cache = sched.cache
        assert cache.allocator.num_free + cache.prefix_cache.num_pages == cache.num_pages
        assert cache.prefix_cache.locked_pages == 0 and not sched.planner.admitted()


def add(sched: Scheduler, prompt_len: int, max_tokens: int, first: int = 3) -> Req:
    req = sched.make_request(
        list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens)
    )
    sched.add_request(req)
    return req


def run(sched: Scheduler) -> dict[int, tuple[list[int], str | None]]:
    """Step until idle: uid -> (tokens, finish reason)."""
    out: dict[int, tuple[list[int], str | None]] = {}
    while sched.has_work:
        for o in sched.step():
            tokens, _ = out.get(o.uid, ([], None))
            out[o.uid] = (tokens + ([] if o.token is None else [o.token]), o.finish_reason)
    return out


def finished(*reqs: Req) -> list[tuple[list[int], str | None]]:
    return [(r.output_ids, r.finish_reason) for r in reqs]


def expected(req: Req, num: int) -> list[int]:
    return [script(req.uid, pos) for pos in range(req.prompt_len, req.prompt_len + num)]


@pytest.mark.parametrize("overlap", [True, False])
def test_long_prompt_is_chunked_within_the_budget(make, overlap):
    sched = make(overlap, max_prefill_tokens=8)
    a, b = add(sched, 20, 2), add(sched, 3, 2, first=50)
    out = run(sched)
    assert sched.engine.batches == [
        ("prefill", [(a.uid, 8)]),
        ("prefill", [(a.uid, 8)]),
        ("prefill", [(a.uid, 4), (b.uid, 3)]),  # b fills what the last chunk leaves
        ("decode", [(a.uid, 1), (b.uid, 1)]),
    ]
    assert out == {a.uid: (expected(a, 2), "length"), b.uid: (expected(b, 2), "length")}


def test_prefill_keeps_a_page_per_running_request(make):
    sched = make(num_pages=8)
    a = add(sched, 4, 8)
    sched.step()
    b = add(sched, 28, 1, first=100)
    sched.step()
    # 7 pages available, one kept for a's next token: b's first chunk gets 6 pages
    assert sched.engine.batches[-1] == ("prefill", [(b.uid, 24)])
    assert sched.cache.allocator.num_free == 1 and sched.planner.prefilling is b
    sched.step()  # b's next chunk would take the reserved page: a decodes into it instead
    assert sched.engine.batches[-1] == ("decode", [(a.uid, 1)])
    run(sched)
    assert b.num_preemptions == 1  # the chunk in progress goes first when a needs a page
    assert finished(a, b) == [(expected(a, 8), "length"), (expected(b, 1), "length")]


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_requeues_the_newest_request_first(make, overlap):
    sched = make(overlap, num_pages=6, max_running_requests=2)
    a, b, c = add(sched, 7, 10), add(sched, 6, 10, first=100), add(sched, 3, 2, first=200)
    while not sched.planner.num_preemptions:  # a (4 pages) and b (3 pages) outgrow the pool
        sched.step()
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert list(sched.planner.waiting) == [b, c] and sched.planner.running == [a]
    # its 11 computed tokens: 2 full pages went to the prefix cache, the partial one to a
    handle, _ = sched.cache.prefix_cache.match_prefix(b.tokens[:11])
    assert handle.length == 2 * PAGE and sched.cache.prefix_cache.evictable_pages == 2
    num_tokens, cached_before = len(b.tokens), sched.planner.num_cached_tokens
    run(sched)
    prefills = [reqs for phase, reqs in sched.engine.batches if phase == "prefill"]
    # once a ends, b comes back ahead of c, with the tokens it generated, its first 2 pages
    # found in the prefix cache
    assert prefills[1:] == [[(b.uid, num_tokens - 2 * PAGE), (c.uid, 3)]]
    assert sched.planner.num_cached_tokens - cached_before == 2 * PAGE
    assert finished(a, b, c) == [(expected(r, n), "length") for r, n in ((a, 10), (b, 10), (c, 2))]


def test_abort_while_its_step_is_in_flight(make):
    sched = make(overlap=True)
    a, b = add(sched, 5, 10), add(sched, 6, 4, first=40)
    assert sched.step() == []
    first = sched.step()
    assert [o.token for o in first] == [script(a.uid, 5), script(b.uid, 6)]
    sched.abort(a.uid)  # its second token is being computed
    assert a.tokens == [*range(3, 8), script(a.uid, 5)]  # the placeholder is gone
    outputs = sched.step()
    assert outputs == [
        TokenOutput(a.uid, None, True, "abort"),
        TokenOutput(b.uid, script(b.uid, 7), False),
    ]
    out = run(sched)
    assert a.uid not in out and out[b.uid] == (expected(b, 4)[2:], "length")
    assert all(a.uid not in [uid for uid, _ in reqs] for _, reqs in sched.engine.batches[2:])


@pytest.mark.parametrize("overlap", [True, False])
def test_max_tokens_zero_ends_without_a_forward(make, overlap):
    sched = make(overlap)
    req = add(sched, 5, 0)
    assert sched.step() == [TokenOutput(req.uid, None, True, "length")]
    assert not sched.has_work and sched.engine.batches == [] and req.output_ids == []


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_returns_the_previous_steps_tokens(make, overlap):
    sched = make(overlap)
    req = add(sched, 3, 3)
    steps = []
    while sched.has_work:
        steps.append([(o.token, o.finished) for o in sched.step()])
    t0, t1, t2 = expected(req, 3)
    if overlap:  # step N launches its forward, then reads step N-1's tokens
        assert steps == [[], [(t0, False)], [(t1, False)], [(t2, True)]]
        order = ["forward 1", "forward 2", "read 1", "forward 3", "read 2", "read 3"]
    else:
        assert steps == [[(t0, False)], [(t1, False)], [(t2, True)]]
        order = ["forward 1", "read 1", "forward 2", "read 2", "forward 3", "read 3"]
    assert [f"{event} {i}" for event, i in sched.engine.log] == order


def test_follower_replays_the_leaders_adds_and_aborts(make, monkeypatch):
    """TP: rank 0 sends its adds and aborts as typed messages at the start of each step; a
    follower that replays them builds the same batches."""
    queue: list[bytes] = []  # rank 0's broadcasts, in order

    def broadcast(obj: bytes | None) -> bytes:  # rank 0 gives its message, a follower None
        if obj is None:
            return queue.pop(0)
        queue.append(obj)
        return obj

    monkeypatch.setattr(tp_mod, "broadcast_object", broadcast)
    lead, follower = make(max_prefill_tokens=8), make(max_prefill_tokens=8)
    lead.leader = tp_mod.TPLeader()
    a, b = add(lead, 12, 5), add(lead, 3, 4, first=30)
    for i in range(6):
        lead.step()
        if i == 2:
            lead.abort(a.uid)  # while its tokens are being computed
    run(lead)
    lead.stop_followers()
    messages = [decode(m) for m in queue]
    assert all(isinstance(m, BatchBackendMsg) for m in messages[:-1])
    assert isinstance(messages[-1], ExitMsg)
    assert [c.params.seed for c in messages[0].msgs] == [a.seed, b.seed]
    assert a.finish_reason == "abort" and a.num_output < 5
    follower.follow()
    assert not queue and follower.engine.batches == lead.engine.batches
