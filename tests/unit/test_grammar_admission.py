"""Issue 52: a constrained request waits for its grammar outside the planner's queue, and no
step ever waits for a compile. On a fake engine (no model) whose sampler takes the lowest token
the grammar mask allows, with compiles the test finishes by hand (a scheduler that asked for an
unfinished one fails the test instead of hanging): admission only once compiled, in arrival
order, failures and overdue compiles ending with an error, TP followers admitting at rank 0's
word, the server loop's poll while only grammars compile; then the real compiler processes: a
compile over its budget is killed, the others go on. Every scheduler ends with no page leaked."""

from __future__ import annotations

import re
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xgrammar as xgr

from minisgl.core import Batch, Req, SamplingParams
from minisgl.ext import held as held_mod
from minisgl.ext.structured import grammar as grammar_mod
from minisgl.ext.structured.grammar import CompileJob, GrammarError, GrammarState, TokenMask
from minisgl.ext.structured.grammar_feature import grammar_state
from minisgl.message import DetokenizeMsg, decode
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler import io as io_mod
from minisgl.scheduler import tp as tp_mod
from minisgl.scheduler.scheduler import Scheduler
from support.invariants import check_no_leak
from support.tokenizer import build_tiny_tokenizer

VOCAB = 512  # the tiny tokenizer's xgrammar vocabulary (support/models.py)
PAGE = 4
REGEX = "a[0-9]b"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def compiled(tokenizer: Any) -> Any:
    """REGEX compiled here, in this process: what a finished compile hands the scheduler."""
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id]
    )
    return xgr.GrammarCompiler(info).compile_regex(REGEX)


class ByHand(Future):
    """A compile that the test finishes; asking for its result before that fails the test."""

    def result(self, timeout: float | None = None) -> Any:
        assert self.done(), "the scheduler waited for a grammar still compiling"
        return super().result(0)

    def exception(self, timeout: float | None = None) -> Any:
        assert self.done(), "the scheduler waited for a grammar still compiling"
        return super().exception(0)


class Compiles:
    """Stands for GrammarState.compiler: one future per grammar text, shared by the ranks."""

    def __init__(self) -> None:
        self.futures: dict[tuple[str, str], Future] = {}

    def compile(self, key: tuple[str, str]) -> Future:
        return self.futures.setdefault(key, ByHand())

    def shutdown(self) -> None:
        pass


class FakeEngine:
    """What the scheduler uses of an Engine; a row under a grammar samples the lowest token its
    mask allows, any other row a token of its request's own (never EOS)."""

    def __init__(self) -> None:
        self.page_size, self.num_pages, self.max_model_len = PAGE, 64, 256
        self.max_seq_len = self.max_model_len
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.config = SimpleNamespace(max_running_requests=8)
        self.device = torch.device("cpu")
        self.graphs = None
        self.compiled_decoder = None
        self.batches: list[list[int]] = []  # the uids of each forward

    def set_pages(self, row: int, start: int, pages: list[int]) -> None:
        pass

    def set_tokens(self, row: int, tokens: list[int], start: int = 0) -> None:
        pass

    def track_adjustments(self, req: Req, eos_token_ids: object) -> None:
        pass

    def forward(self, batch: Batch, samples: list[bool]) -> list[Req]:
        self.batches.append([r.uid for r in batch.reqs])
        return list(batch.reqs)

    def sample(self, batch: Batch, reqs: list[Req], prepared: dict | None) -> Any:
        mask: TokenMask | None = (prepared or {}).get("grammar")
        tokens = [300 + r.uid % 100 for r in reqs]
        for row in mask.rows if mask is not None else []:
            words = mask.bitmask[row].to(torch.int64) & 0xFFFFFFFF
            bits = (words[:, None] >> torch.arange(32)) & 1
            tokens[row] = int(bits.flatten()[:VOCAB].nonzero()[0])
        return SimpleNamespace(
            prompt=None,
            tokens=lambda: tokens,
            logprobs=lambda: None,
            verified=dict,
            prompt_logprobs=dict,
            results={},
        )


@pytest.fixture
def make(tokenizer: Any, monkeypatch: pytest.MonkeyPatch):
    """make(compiles) -> a Scheduler on a FakeEngine over `compiles` (a fresh Compiles if
    None), compile deadline 3 s; when the test ends each runs to the end (unfinished compiles
    failed first) and must own no page."""
    made: list[Scheduler] = []

    def build(compiles: Compiles | None = None) -> Scheduler:
        config = SchedulerConfig.from_options({"grammar_compile_timeout": 3})
        sched = Scheduler(FakeEngine(), config, {tokenizer.eos_token_id}, tokenizer)  # type: ignore[arg-type]
        grammar_state(sched).compiler = compiles or Compiles()  # type: ignore[assignment]
        made.append(sched)
        return sched

    yield build
    for sched in made:
        for req in grammar_state(sched).compiling:
            if not req.ext["grammar"].future.done():  # type: ignore[union-attr]
                req.ext["grammar"].future.set_exception(GrammarError("test over"))  # type: ignore[union-attr]
        run(sched)
        check_no_leak(sched)
        cache = sched.cache
        assert cache.allocator.num_free + cache.prefix_cache.num_pages == cache.num_pages
        assert not sched.planner.admitted() and not grammar_state(sched).compiling


def add(sched: Scheduler, first: int, **constraint: str) -> Req:
    params = SamplingParams(max_tokens=6, **constraint)  # type: ignore[arg-type]
    req = sched.make_request(list(range(first, first + 5)), params)
    sched.add_request(req)
    return req


def run(sched: Scheduler) -> list[DetokenizeMsg]:
    outputs = []
    while sched.has_work:
        outputs += sched.step()
    return outputs


def runnable(sched: Scheduler) -> bool:  # work other than the held requests
    return bool(sched.planner.busy or sched.pending or sched.in_flight)


def text(tokenizer: Any, req: Req) -> str:
    ids = [t for t in req.output_ids if t != tokenizer.eos_token_id]
    return tokenizer.decode(ids)


def test_a_request_is_admitted_only_once_its_grammar_is_compiled(make, tokenizer, compiled):
    sched = make()
    constrained, plain = add(sched, 10, regex=REGEX), add(sched, 20)
    future = grammar_state(sched).compiler.futures[("regex", REGEX)]
    while runnable(sched):  # the plain request runs to its end meanwhile; no step waits
        sched.step()
    assert plain.finish_reason == "length" and len(plain.output_ids) == 6
    assert sched.has_work and grammar_state(sched).compiling == [constrained]
    assert constrained not in sched.planner.waiting and constrained.table_idx < 0
    assert all(constrained.uid not in uids for uids in sched.engine.batches)
    sched.step()  # still compiling: a step changes nothing
    assert grammar_state(sched).compiling == [constrained] and constrained.queue_time is None
    future.set_result(compiled)
    run(sched)
    assert constrained.finish_reason == "stop" and re.fullmatch(REGEX, text(tokenizer, constrained))
    assert constrained.queue_time is not None  # counted from its arrival: the compile is in it


def test_ready_grammars_are_admitted_in_arrival_order(make, compiled):
    sched = make()
    first, slow, last = (add(sched, 10 * i, regex=f"a[0-9]b{'c' * i}") for i in range(1, 4))
    futures = grammar_state(sched).compiler.futures
    futures[("regex", last.params.get("regex"))].set_result(compiled)
    futures[("regex", first.params.get("regex"))].set_result(compiled)
    sched.step()
    assert sched.engine.batches == [[first.uid, last.uid]]
    assert grammar_state(sched).compiling == [slow]
    futures[("regex", slow.params.get("regex"))].set_result(compiled)
    run(sched)
    assert [r.finish_reason for r in (first, slow, last)] == ["stop"] * 3


def test_failed_and_overdue_grammars_end_with_an_error(make):
    sched = make()
    bad, overdue = add(sched, 10, regex="([a-"), add(sched, 20, regex="a+")
    queued = add(sched, 30, regex="b+")  # waits for a compiler process: its clock has not started
    bad.ext["grammar"].future.set_exception(GrammarError("invalid regex: Unclosed '['"))  # type: ignore[union-attr]
    overdue.ext["grammar"].future = CompileJob("regex", "a+", False, 3)  # type: ignore[union-attr]
    overdue.ext["grammar"].future.started_at = time.monotonic() - 4  # type: ignore[union-attr]
    overdue.ext["grammar"].deadline -= 4  # type: ignore[union-attr]
    queued.ext["grammar"].future = CompileJob("regex", "b+", False, 3)  # type: ignore[union-attr]
    queued.ext["grammar"].deadline -= 4  # type: ignore[union-attr]
    outputs = {o.uid: o for o in sched.step()}
    assert outputs[bad.uid].finish_reason == "error" and bad.error == "invalid regex: Unclosed '['"
    assert outputs[overdue.uid].error == "grammar compilation took longer than 3 s"
    assert queued.uid not in outputs and grammar_state(sched).compiling == [queued]
    assert sched.engine.batches == [] and not runnable(sched)
    queued.ext["grammar"].future.started_at = time.monotonic() - 4  # type: ignore[union-attr]
    assert [o.error for o in sched.step()] == ["grammar compilation took longer than 3 s"]
    assert grammar_state(sched).num_constrained == 0 and not sched.has_work


def test_followers_admit_and_drop_at_rank_0s_word(make, monkeypatch, compiled):
    """TP: a follower hears of the request at once (its compile starts with rank 0's) and
    admits it at the step rank 0 does; a grammar that fails on rank 0 reaches it as an abort."""
    queue: list[bytes] = []

    def broadcast(obj: bytes | None) -> bytes:  # rank 0 gives its message, a follower None
        if obj is None:
            return queue.pop(0)
        queue.append(obj)
        return obj

    monkeypatch.setattr(tp_mod, "broadcast_object", broadcast)
    compiles = Compiles()
    lead, follower = make(compiles), make(compiles)
    lead.leader, follower.follower = tp_mod.TPLeader(), True
    ok, bad, plain = add(lead, 10, regex=REGEX), add(lead, 20, regex="x("), add(lead, 30)
    for _ in range(3):
        lead.step()
    compiles.futures[("regex", REGEX)].set_result(compiled)
    compiles.futures[("regex", "x(")].set_exception(GrammarError("invalid regex"))
    run(lead)
    lead.stop_followers()
    changes = [[type(c).__name__ for c in decode(m).msgs] for m in queue[:-1]]
    assert changes[0] == ["UserMsg"] * 3 and ["AdmitBackendMsg", "AbortBackendMsg"] in changes
    assert changes.index(["AdmitBackendMsg", "AbortBackendMsg"]) == 3  # the step after
    follower.follow()
    assert not queue and follower.engine.batches == lead.engine.batches
    assert [r.finish_reason for r in (ok, bad, plain)] == ["stop", "error", "length"]
    assert not follower.requests and not grammar_state(follower).compiling


class Recv:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def get(self, timeout: float | None = None) -> None:
        self.calls.append(("get", timeout))

    def get_nowait(self) -> None:
        self.calls.append("nowait")


def test_server_loop_polls_while_only_grammars_compile(make, compiled, monkeypatch) -> None:
    """Idle: block; work to step: don't wait; only grammars compiling: a step waits a little
    (neither a hot loop nor a long sleep)."""
    sched, sleeps = make(), []
    monkeypatch.setattr(held_mod, "sleep", sleeps.append)
    server = io_mod.SchedulerServer.__new__(io_mod.SchedulerServer)
    server.scheduler, server.recv = sched, Recv()  # type: ignore[assignment]
    server._next_message()
    req = add(sched, 10, regex=REGEX)
    server._next_message()
    sched.step()
    assert sleeps == [held_mod.HOLD_POLL_S]
    add(sched, 20)
    server._next_message()
    sched.step()
    assert server.recv.calls == [("get", None), "nowait", "nowait"]
    assert sleeps == [held_mod.HOLD_POLL_S] and 0.005 <= held_mod.HOLD_POLL_S <= 0.05
    grammar_state(sched).compiler.futures[("regex", REGEX)].set_result(compiled)
    run(sched)
    assert req.finish_reason == "stop"


# ---- the compiler processes ------------------------------------------------------------------
def nested_arrays(depth: int) -> str:
    """The issue's hog: 1,100 nested arrays keep xgrammar busy for minutes."""
    schema = '{"type": "integer"}'
    for _ in range(depth):
        schema = '{"type": "array", "items": ' + schema + "}"
    return schema


def test_a_compile_over_its_budget_is_killed_and_the_others_go_on(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(grammar_mod, "LINGER_S", 0.0)
    state = GrammarState(VOCAB, 4, pin=False, timeout=2)
    eos = {tokenizer.eos_token_id}
    try:
        hog = state.constraint(SamplingParams(json_schema=nested_arrays(1100)), tokenizer, eos)
        assert hog is not None and state.compiler is not None
        small = state.constraint(SamplingParams(regex=REGEX), tokenizer, eos)
        assert small is not None and small.wait().accept_string("a1b")  # another process
        with pytest.raises(GrammarError, match="took longer than 2 s"):
            hog.wait()
        assert hog.future.exception() is not None  # the pool's verdict (the process killed)
        pool = state.compiler.pool
        assert pool is not None
        again = state.constraint(SamplingParams(json_schema=nested_arrays(1100)), tokenizer, eos)
        assert again is not None and again.failure() == "grammar compilation took longer than 2 s"
        other = state.constraint(SamplingParams(regex="[xy]{2}"), tokenizer, eos)
        assert other is not None and other.wait().accept_string("xy")
        procs = [w.proc for w in pool.workers]
        assert 1 <= len(procs) <= grammar_mod.MAX_WORKERS
    finally:
        state.shutdown()
    for proc in procs:
        assert proc.wait(10) is not None  # shut down with the last GrammarState over them
    assert state.compiler is not None and state.compiler.key not in grammar_mod._POOLS


def test_the_flag() -> None:
    from minisgl.server.args import parse_args

    timeout = SchedulerConfig().extras["structured"].grammar_compile_timeout
    assert timeout == grammar_mod.COMPILE_TIMEOUT_S == 30
    args = parse_args(["--model", "m", "--grammar-compile-timeout", "2.5"])
    assert args.scheduler.extras["structured"].grammar_compile_timeout == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--grammar-compile-timeout", bad])
