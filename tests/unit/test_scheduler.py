"""The Scheduler on a fake engine (no model): which batches it builds, in which order, with which
pages, and which tokens come out of which step. The fake forward records each batch and checks
what a real one would read (page-table rows, known input tokens); sampled tokens come from a
script of (uid, position)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.extension import extensions
from minisgl.message import BatchMsg, DetokenizeMsg, ExitMsg, decode
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler import tp as tp_mod
from minisgl.scheduler.planner import reaches_length
from minisgl.scheduler.scheduler import PLACEHOLDER, Scheduler
from support.invariants import check_no_leak

EOS = 2
PAGE = 4


def script(uid: int, pos: int) -> int:
    """The token a request samples at `pos`: differs by request and position, never EOS."""
    return 10 + (7 * uid + 3 * pos) % 900


class FakeStep:
    results: dict = {}  # nothing observed by step features (no logprobs)

    def __init__(self, engine: FakeEngine, index: int, tokens: list[int]) -> None:
        self.engine, self.index, self._tokens = engine, index, tokens

    def tokens(self) -> list[int]:
        self.engine.log.append(("read", self.index))
        return self._tokens

    def logprobs(self) -> None:
        return None

    def verified(self) -> dict:
        return {}

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
        self.graphs = None  # no CUDA graphs: no step is capped to fit them
        self.page_table: dict[int, list[int]] = {}
        self.token_table: dict[int, dict[int, int]] = {}
        self.batches: list[tuple[str, list[tuple[int, int]]]] = []  # (phase, [(uid, extend)])
        self.log: list[tuple[str, int]] = []  # ("forward", i) and ("read", i), in order

    def set_pages(self, row: int, start: int, pages: list[int]) -> None:
        table = self.page_table.setdefault(row, [])
        assert start <= len(table), "a hole in the page-table row"
        table[start : start + len(pages)] = pages

    def set_tokens(self, row: int, tokens: list[int], start: int = 0) -> None:
        assert start == 0, "no proposals here"
        self.token_table[row] = dict(enumerate(tokens))

    def forward(self, batch: Batch, samples: list[bool]) -> list[tuple[int, int] | None]:
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
        phase = "mixed" if batch.num_decodes else batch.phase
        assert all(r.extend_len == 1 for r in batch.reqs[: batch.num_decodes])
        self.batches.append((phase, [(r.uid, r.extend_len) for r in batch.reqs]))
        self.log.append(("forward", len(self.batches)))
        ends = [(r.table_idx, r.cached_len + r.extend_len) for r in batch.reqs]
        return [end if sampled else None for end, sampled in zip(ends, samples)]

    def track_adjustments(self, req: Req, eos_token_ids: object) -> None:
        pass

    def sample(self, batch: Batch, forward: list, mask: object = None) -> FakeStep:
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
    test ends, each one runs to the end and must have every page free or in the prefix cache.
    `config`: SchedulerConfig fields (mixed steps on unless disable_mixed_steps)."""
    made: list[Scheduler] = []

    def build(
        overlap: bool = True,
        max_prefill_tokens: int = 8192,
        config: dict | None = None,
        **engine: int,
    ) -> Scheduler:
        monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
        options = SchedulerConfig.from_options(
            {"max_prefill_tokens": max_prefill_tokens, **(config or {})}
        )
        made.append(Scheduler(FakeEngine(**engine), options, {EOS}))
        return made[-1]

    yield build
    for sched in made:
        run(sched)
        check_no_leak(sched)
        cache = sched.cache
        assert cache.allocator.num_free + cache.prefix_cache.num_pages == cache.num_pages
        assert cache.prefix_cache.locked_pages == 0 and not sched.planner.admitted()


def add(
    sched: Scheduler, prompt_len: int, max_tokens: int, first: int = 3, priority: int = 0
) -> Req:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    req = sched.make_request(list(range(first, first + prompt_len)), params)
    sched.add_request(req)
    return req


def run(sched: Scheduler) -> dict[int, tuple[list[int], str | None]]:
    """Step until idle: uid -> (tokens, finish reason)."""
    out: dict[int, tuple[list[int], str | None]] = {}
    while sched.has_work:
        for o in sched.step():
            tokens, _ = out.get(o.uid, ([], None))
            out[o.uid] = (tokens + o.token_ids, o.finish_reason)
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


@pytest.mark.skipif(
    "perf" not in extensions().scheduler_options, reason="the perf extension's budget"
)
def test_steps_fit_the_graph_rows_when_little_waits(make):
    """With CUDA graphs of 8 rows, a step is capped to fit them (ext/perf's prefill rows)
    while the prompts waiting fit in three such steps beside the decodes; a larger backlog, a
    prompt longer than 16 tokens, or decodes that leave a single row keep the budget's
    chunks."""
    sched = make(False, max_prefill_tokens=64)
    sched.engine.graphs = SimpleNamespace(max_bs=8)
    a = add(sched, 12, 3)
    sched.step()
    assert sched.engine.batches[-1] == ("prefill", [(a.uid, 8)])  # 12 <= 16: capped to 8
    b = add(sched, 40, 1, first=100)  # 4 + 40 waiting: a backlog
    sched.step()
    assert sched.engine.batches[-1] == ("prefill", [(a.uid, 4), (b.uid, 40)])
    c = add(sched, 10, 1, first=300)  # 10 waiting, a decoding: 7 rows left beside it
    sched.step()
    assert sched.engine.batches[-1] == ("mixed", [(a.uid, 1), (c.uid, 7)])
    run(sched)
    sched.planner.max_prefill_tokens = 10  # a 25-token prompt's tail (15) is not capped:
    e = add(sched, 25, 1, first=700)  # its rows would read its first 10 tokens' KV too
    sched.step()
    sched.step()
    assert sched.engine.batches[-2:] == [("prefill", [(e.uid, 10)]), ("prefill", [(e.uid, 10)])]
    run(sched)
    sched.planner.max_prefill_tokens = 64
    decoding = [add(sched, 2, 6, first=800 + 10 * i) for i in range(7)]
    while sched.planner.waiting or sched.planner.prefilling:
        sched.step()
    f = add(sched, 10, 1, first=900)  # 7 decodes leave 1 row: 10 steps for it, not 3
    sched.step()
    assert sched.engine.batches[-1] == ("mixed", [(r.uid, 1) for r in decoding] + [(f.uid, 10)])
    run(sched)
    sched.engine.graphs = None  # no graphs: one chunk
    d = add(sched, 12, 1, first=500)
    sched.step()
    assert sched.engine.batches[-1] == ("prefill", [(d.uid, 12)])
    run(sched)


def test_prefill_keeps_a_page_per_running_request(make):
    sched = make(num_pages=8, config={"disable_mixed_steps": True})
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
    assert [o.token_ids for o in first] == [[script(a.uid, 5)], [script(b.uid, 6)]]
    sched.abort(a.uid)  # its second token is being computed
    assert a.tokens == [*range(3, 8), script(a.uid, 5)]  # the placeholder is gone
    outputs = sched.step()
    assert outputs == [
        DetokenizeMsg(a.uid, [], True, "abort"),
        DetokenizeMsg(b.uid, [script(b.uid, 7)], False, None),
    ]
    out = run(sched)
    assert a.uid not in out and out[b.uid] == (expected(b, 4)[2:], "length")
    assert all(a.uid not in [uid for uid, _ in reqs] for _, reqs in sched.engine.batches[2:])


@pytest.mark.parametrize("overlap", [True, False])
def test_max_tokens_zero_ends_without_a_forward(make, overlap):
    sched = make(overlap)
    req = add(sched, 5, 0)
    assert sched.step() == [DetokenizeMsg(req.uid, [], True, "length")]
    assert not sched.has_work and sched.engine.batches == [] and req.output_ids == []


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_returns_the_previous_steps_tokens(make, overlap):
    sched = make(overlap)
    req = add(sched, 3, 3)
    steps = []
    while sched.has_work:
        steps.append([(*o.token_ids, o.finished) for o in sched.step()])
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
    assert all(isinstance(m, BatchMsg) for m in messages[:-1])
    assert isinstance(messages[-1], ExitMsg)
    assert [c.params.seed for c in messages[0].msgs] == [a.seed, b.seed]
    assert a.finish_reason == "abort" and a.num_output < 5
    follower.follow()
    assert not queue and follower.engine.batches == lead.engine.batches


# ---- mixed steps, token budget, scheduling policies (issue 22) ---------------------------


def admissions(sched: Scheduler) -> list[int]:
    """uids in the order their first prompt chunk was computed."""
    seen: list[int] = []
    for phase, reqs in sched.engine.batches:
        seen += [uid for uid, n in reqs if n > 1 or phase == "prefill" and uid not in seen]
    return list(dict.fromkeys(seen))


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_steps_keep_every_running_request_decoding(make, overlap):
    budget = 16
    sched = make(overlap, config={"max_num_batched_tokens": budget})
    plain = make(overlap, max_prefill_tokens=budget, config={"disable_mixed_steps": True})
    schedule, decodable = sched.planner.schedule, []

    def watched() -> Batch | None:  # the running requests due a token, seen before planning
        due = [r.uid for r in sched.planner.running if not reaches_length(r, len(r.tokens))]
        decodable.append(due)
        return schedule()

    sched.planner.schedule = watched  # type: ignore[method-assign]
    for s in (sched, plain):  # a and b decode while c and d are prefilled in chunks
        reqs = [add(s, 5, 30), add(s, 6, 30, first=20)]
        for _ in range(3):
            s.step()
        reqs += [add(s, 40, 4, first=100), add(s, 23, 4, first=200)]
        run(s)
        assert finished(*reqs) == [(expected(r, n), "length") for r, n in zip(reqs, (30, 30, 4, 4))]
    mixed = [(p, reqs) for p, reqs in sched.engine.batches if p == "mixed"]
    assert len(mixed) >= 4  # c's 40 and d's 23 tokens go in chunks beside the decodes
    for (phase, reqs), due in zip(sched.engine.batches, decodable):
        assert sum(n for _, n in reqs) <= budget or phase == "decode"
        assert set(due) <= {uid for uid, _ in reqs}, (phase, reqs, due)
    # without mixed steps the prompts' chunks are steps of their own: the decodes wait
    assert sum(p == "prefill" for p, _ in plain.engine.batches) > 2
    assert not any(p == "mixed" for p, _ in plain.engine.batches)


@pytest.mark.ext  # the serving extension's policies
def test_priority_policy_admits_lower_values_first(make):
    sched = make(max_running_requests=1, config={"schedule_policy": "priority"})
    first = add(sched, 4, 3)
    sched.step()
    low, mid, high = (
        add(sched, 4, 2, first=10 * i, priority=p) for i, p in ((2, 5), (3, 1), (4, -1))
    )
    run(sched)
    assert admissions(sched) == [first.uid, high.uid, mid.uid, low.uid]
    assert finished(high, mid, low) == [(expected(r, 2), "length") for r in (high, mid, low)]


@pytest.mark.ext  # the serving extension's policies
def test_priority_aging_bounds_how_often_a_request_is_overtaken(make):
    config = {"schedule_policy": "priority", "priority_aging": 2}
    sched = make(max_running_requests=1, config=config)
    first = add(sched, 4, 3)
    sched.step()
    low = add(sched, 4, 2, first=10, priority=1)  # queued after 1 admission: ranks 1 + 1/2
    highs = []
    for i in range(4):  # each queued one admission after the one before: ranks (i + 1) / 2
        highs.append(add(sched, 4, 2, first=20 + 10 * i, priority=0))
        while highs[-1].table_idx < 0 and low.table_idx < 0:
            sched.step()
    run(sched)
    # two high ones (ranks 0.5, 1) go before it; the third (rank 1.5) ties and came later
    assert admissions(sched) == [
        first.uid,
        *[h.uid for h in highs[:2]],
        low.uid,
        highs[2].uid,
        highs[3].uid,
    ]


@pytest.mark.ext  # the serving extension's policies
def test_priority_burst_keeps_its_order_however_long(make):
    """Aging counts admissions, not arrivals: a burst queued at once (here five times the
    aging) runs all its high-priority requests first (by arrivals, the early low ones ranked
    before the late high ones)."""
    config = {"schedule_policy": "priority", "priority_aging": 2}
    sched = make(max_running_requests=1, config=config)
    first = add(sched, 4, 3)
    sched.step()
    mixed = [add(sched, 4, 2, first=10 + 10 * i, priority=i % 2) for i in range(10)]
    run(sched)
    highs, lows = mixed[0::2], mixed[1::2]
    assert admissions(sched) == [first.uid, *[r.uid for r in highs + lows]]


@pytest.mark.ext  # the serving extension's policies
@pytest.mark.parametrize("mixed", [True, False])
def test_higher_priority_preempts_a_lower_one_when_memory_is_short(make, mixed):
    config = {"schedule_policy": "priority", "disable_mixed_steps": not mixed}
    sched = make(num_pages=8, max_running_requests=4, config=config)
    low = add(sched, 12, 12, priority=5)  # 3 pages, growing to 6
    for _ in range(4):
        sched.step()
    high = add(sched, 16, 2, first=100, priority=0)  # 4 pages + 1: not there without low's
    run(sched)
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert finished(low, high) == [(expected(low, 12), "length"), (expected(high, 2), "length")]
    # the other way round: a lower-priority arrival waits instead of preempting
    sched2 = make(num_pages=8, max_running_requests=4, config=config)
    high2 = add(sched2, 12, 12, priority=0)
    for _ in range(4):
        sched2.step()
    low2 = add(sched2, 16, 2, first=100, priority=5)
    run(sched2)
    assert high2.num_preemptions == 0 and low2.output_ids == expected(low2, 2)


@pytest.mark.ext  # the serving extension's policies
@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_higher_priority_arrival_preempts_for_a_page_table_row(make, policy):
    """No row is free: under priority the arrival preempts the running request ranked after
    it (the queue's `victim_for`: no decode runs short of pages here); under fcfs it waits."""
    sched = make(max_running_requests=1, config={"schedule_policy": policy})
    low = add(sched, 4, 8, priority=5 if policy == "priority" else 0)
    for _ in range(3):
        sched.step()
    high = add(sched, 4, 2, first=100)
    run(sched)
    assert (low.num_preemptions, high.num_preemptions) == (int(policy == "priority"), 0)
    assert finished(low, high) == [(expected(low, 8), "length"), (expected(high, 2), "length")]


@pytest.mark.ext  # the serving extension's policies
def test_lpm_admits_the_longest_cached_prefix_first(make):
    sched = make(max_running_requests=1, config={"schedule_policy": "lpm"})
    shared = list(range(50, 62))  # 3 pages
    warm = sched.make_request(shared + [7], SamplingParams(max_tokens=1))
    sched.add_request(warm)
    run(sched)  # its prompt's pages stay in the prefix cache
    first = add(sched, 4, 3)
    sched.step()
    cold = add(sched, 13, 2, first=300)
    hot = sched.make_request(shared + [8], SamplingParams(max_tokens=2))
    sched.add_request(hot)
    run(sched)
    assert admissions(sched)[-3:] == [first.uid, hot.uid, cold.uid]
    assert hot.output_ids == expected(hot, 2) and cold.output_ids == expected(cold, 2)


@pytest.mark.ext  # the serving extension's policies
@pytest.mark.parametrize("overlap", [True, False])
def test_followers_plan_priority_and_mixed_steps_alike(make, monkeypatch, overlap):
    """The order depends on nothing a follower does not replay (arrival is a count)."""
    queue: list[bytes] = []

    def broadcast(obj: bytes | None) -> bytes:
        if obj is None:
            return queue.pop(0)
        queue.append(obj)
        return obj

    monkeypatch.setattr(tp_mod, "broadcast_object", broadcast)
    config = {"schedule_policy": "priority", "priority_aging": 3, "max_num_batched_tokens": 12}
    lead, follower = (make(overlap, num_pages=12, config=config) for _ in range(2))
    lead.leader = tp_mod.TPLeader()
    for i in range(8):
        add(lead, 5 + 3 * i, 6, first=40 * i, priority=(7 * i) % 3)
        lead.step()
    run(lead)
    lead.stop_followers()
    follower.follow()
    assert follower.engine.batches == lead.engine.batches


# ---- the scheduler process's messages -----------------------------------------------------
@dataclass
class UnknownMsg:
    uid: int


@dataclass
class ExtensionMsg:
    uid: int


def test_the_scheduler_process_hands_extension_messages_on_and_drops_unknown_ones(
    monkeypatch, caplog
):
    """`SchedulerServer.handle`: a message type the core does not know goes to its handler in
    the `scheduler_messages` point (ext/serving's /flush_cache); any other is logged, dropped,
    and the process serves on."""
    from minisgl import extension
    from minisgl.scheduler import io as io_mod

    monkeypatch.setattr(extension, "_EXTENSIONS", extension.Extensions(loaded=True))
    seen: list[tuple[object, object]] = []
    extension.extensions().scheduler_messages[ExtensionMsg] = lambda s, m: seen.append((s, m))
    server = io_mod.SchedulerServer.__new__(io_mod.SchedulerServer)
    assert server.handle(ExtensionMsg(1)) is True
    assert seen == [(server, ExtensionMsg(1))]
    with caplog.at_level("WARNING", logger=io_mod.__name__):
        assert server.handle(UnknownMsg(2)) is True
    assert "scheduler ignores unexpected message 'UnknownMsg'" in caplog.text
    assert seen == [(server, ExtensionMsg(1))]
    assert server.handle(ExitMsg()) is False
