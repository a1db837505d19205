"""The admission policies of the serving extension (`minisgl/ext/serving/policy.py`: the
`admission_policies` and `sampling_params` points) and the core without them (issue 46): the
core's waiting queue is first come first served and never lets a waiting request preempt a
running one; alone it refuses a request's `priority` (a ValueError naming it) and every
--schedule-policy but fcfs (a CLI error naming the flag). With the extension, the queue orders
below; the scheduler-level tests (admission order, aging, preemption, TP followers) are in
test_scheduler.py, the HTTP ones in tests/server/test_sampling_http.py and
test_ext_sampling_http.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from minisgl import LLM, SamplingParams, extension
from minisgl.core import PLACEHOLDER, Req
from minisgl.extension import ExtensionMissing
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler.queue import WaitingQueue, make_queue
from minisgl.utils.options import OptionError

MISSING = "needs the serving extension (minisgl/ext/serving)"


def request(priority: int = 0, tokens: list[int] | None = None) -> Req:
    tokens = tokens or [1, 2, 3]
    return Req(tokens, len(tokens), SamplingParams(priority=priority), max_total_len=64)


def fake_cache(prefixes: dict[int, int] | None = None) -> Any:
    """A KV cache whose cached length of a prompt is `prefixes[its first token]`."""
    length = SimpleNamespace(cached_length=lambda tokens: (prefixes or {}).get(tokens[0], 0))
    return SimpleNamespace(prefix_cache=length)


def queue(policy: str, aging: int = 0, cache: Any = None, *reqs: Req) -> WaitingQueue:
    aging_option = {"priority_aging": aging} if policy != "fcfs" else {}  # the serving ext's
    config = SchedulerConfig.from_options({"schedule_policy": policy, **aging_option})
    q = make_queue(config, cache or fake_cache())
    for req in reqs:
        q.append(req)
    return q


def test_the_extension_fills_its_points() -> None:
    from minisgl.ext.serving import policy

    points = extension.extensions()
    assert points.admission_policies == {
        "priority": policy.PriorityQueue,
        "lpm": policy.LongestPrefixQueue,
    }
    assert points.sampling_params["priority"] is policy.check_priority
    assert type(queue("priority")) is policy.PriorityQueue
    assert type(queue("lpm")) is policy.LongestPrefixQueue


@pytest.mark.parametrize("value", [True, 1.5, "high", 2**31, -(2**31) - 1])
def test_bad_priorities_are_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^priority must be"):
        SamplingParams(priority=value)


def test_priorities_in_int32_pass() -> None:
    assert [SamplingParams(priority=p).get("priority") for p in (-(2**31), -3, 7, 2**31 - 1)] == [
        -(2**31),
        -3,
        7,
        2**31 - 1,
    ]


def test_an_unknown_policy_names_those_there_are() -> None:
    with pytest.raises(OptionError, match="expected one of fcfs, priority, lpm") as info:
        SchedulerConfig(schedule_policy="sjf")
    assert info.value.name == "schedule_policy"


def test_the_flags_reach_the_scheduler_config() -> None:
    from minisgl.server.args import parse_args

    args = parse_args(["--schedule-policy", "priority", "--priority-aging", "3"])
    assert args.scheduler.schedule_policy == "priority"
    assert args.scheduler.extras["serving"].priority_aging == 3


def test_priority_orders_by_aged_rank_and_preempts_only_later_ranks() -> None:
    low, high, later_high, mid, lowest = (request(p) for p in (5, -1, -1, 0, 9))
    q = queue("priority", 0, None, low, high, later_high, mid, lowest)
    assert q.first() is high  # ties: the earlier arrival
    q.remove(high)
    assert q.first() is later_high
    # preemption: the running request ranked last, and only when it ranks after the newcomer
    assert q.victim_for(mid, [high, low]) is low
    assert q.victim_for(lowest, [high, low]) is None
    assert q.victim_for(mid, []) is None
    assert q.decode_victim([high], low) is low  # the half-prefilled one ranks last here
    assert q.decode_victim([low, high], None) is low  # not the newest: the last ranked
    # aging: a request queued after `aging` more admissions ranks one level lower
    reqs, aged = [], queue("priority", 2, None)
    for priority in (1, 0, 0, 0):  # each queued one admission after the one before
        reqs.append(request(priority))
        aged.append(reqs[-1])
        admitted = request()
        aged.append(admitted)
        admitted.table_idx = 0  # given a row: its removal is an admission
        aged.remove(admitted)
    assert [aged.rank(r) for r in reqs] == [(1.0, 0), (0.5, 2), (1.0, 4), (1.5, 6)]
    dropped = request()  # a request dropped while waiting (no row) is no admission
    aged.append(dropped)
    aged.remove(dropped)
    assert aged.num_admitted == 4  # type: ignore[attr-defined]
    # a burst queued between two admissions keeps its priorities, however long
    burst = [request(i % 2) for i in range(10)]
    assert [queue("priority", 2, None, *burst).rank(r) for r in burst] == [
        (i % 2, i) for i in range(10)
    ]
    assert aged.first() is reqs[1]
    assert aged.victim_for(reqs[0], reqs[1:]) is reqs[3]  # 1.5 after 1.0
    assert aged.victim_for(reqs[0], reqs[1:3]) is reqs[2]  # a tie: the later arrival
    assert aged.victim_for(reqs[0], reqs[1:2]) is None


def test_a_preempted_request_keeps_its_arrival() -> None:
    first, second = request(0), request(0)
    q = queue("priority", 1, None, first)
    first.table_idx = 0
    q.remove(first)  # admitted
    q.append(second)  # queued one admission later: a level lower
    first.table_idx = -1
    q.appendleft(first)  # preempted: back in front with its arrival and age
    assert [q.rank(r) for r in q] == [(0.0, 0), (1.0, 1)]
    assert q.first() is first


def test_lpm_admits_the_longest_cached_prefix_then_the_oldest() -> None:
    cold, hot, warm, hot2 = (request(tokens=[t, 9]) for t in (10, 20, 30, 20))
    q = queue("lpm", 0, fake_cache({20: 8, 30: 4}), cold, hot, warm, hot2)
    assert q.first() is hot
    q.remove(hot)
    assert q.first() is hot2
    assert q.victim_for(cold, [warm]) is None  # it preempts as fcfs does
    assert q.decode_victim([warm, hot], None) is hot


def test_lpm_is_fcfs_beyond_its_queue_limit() -> None:
    from minisgl.ext.serving.policy import LPM_MAX_QUEUE

    reqs = [request(tokens=[10, i]) for i in range(LPM_MAX_QUEUE - 1)] + [request(tokens=[20])]
    q = queue("lpm", 0, fake_cache({20: 8}), *reqs)
    assert q.first() is reqs[-1]
    q.append(request(tokens=[10]))  # one more than it ranks
    assert q.first() is reqs[0]


@pytest.mark.parametrize("policy", ["priority", "lpm"])
def test_a_request_preempted_this_step_blocks_the_queue(policy: str) -> None:
    """Its last token is in flight: nothing is admitted before it, next step."""
    req = request(-5, tokens=[20, PLACEHOLDER])
    q = queue(policy, 0, fake_cache({20: 8}), request(), req)
    assert q.first() is None


# ---- the core alone ---------------------------------------------------------------------


@pytest.mark.core
def test_the_core_queue_is_fcfs_and_never_preempts_for_a_waiting_request(
    core_alone: None,
) -> None:
    a, b, c = request(), request(), request()
    q = queue("fcfs", 0, None, a, b)
    assert type(q) is WaitingQueue and q.first() is a
    q.remove(a)
    q.appendleft(c)  # preempted: in front
    assert list(q) == [c, b] and q.first() is c
    assert q.victim_for(b, [a]) is None
    assert q.decode_victim([a, b], None) is b and q.decode_victim([a], c) is c
    assert queue("fcfs", 0, None, request(tokens=[4, PLACEHOLDER])).first() is None


@pytest.mark.core
def test_priority_needs_the_extension(core_alone: None) -> None:
    assert SamplingParams(priority=0).ext == {}  # the default asks for nothing
    for value in (1, -3, 2**40, True):
        with pytest.raises(ExtensionMissing) as info:
            SamplingParams(priority=value)
        assert str(info.value) == f"priority {MISSING}"


@pytest.mark.core
@pytest.mark.parametrize("policy", ["priority", "lpm", "sjf"])
def test_policies_but_fcfs_need_the_extension(
    core_alone: None, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from minisgl.server.args import parse_args

    with pytest.raises(OptionError) as info:
        SchedulerConfig(schedule_policy=policy)
    assert info.value.name == "schedule_policy"
    assert str(info.value) == f"--schedule-policy {policy} {MISSING}"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--schedule-policy", policy])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --schedule-policy: --schedule-policy {policy} {MISSING}" in err, err
    assert parse_args(["--schedule-policy", "fcfs"]).scheduler.schedule_policy == "fcfs"


@pytest.mark.core
def test_llm_refuses_a_policy_without_it(core_alone: None) -> None:
    """Before anything loads: the options are checked first."""
    with pytest.raises(OptionError) as info:
        LLM("no-such-model", schedule_policy="priority")
    assert str(info.value) == f"--schedule-policy priority {MISSING}"
