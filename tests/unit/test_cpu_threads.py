"""The cpu extension's thread count (`minisgl/ext/cpu/threads.py`, `--cpu-threads`): the
governor's decisions under a fake clock whose steps cost what the test says (no timed
assertion), an explicit count (the flag, OMP_NUM_THREADS) never governed, and greedy tokens
that do not depend on the count it picks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.ext.cpu import threads
from minisgl.ext.cpu.options import CpuOptions
from minisgl.ext.cpu.threads import GovernedThreads, ThreadGovernor, governed_threads
from minisgl.extension import ExtensionMissing
from minisgl.utils.options import OptionError


class FakeSteps:
    """A governor on a fake clock: each step costs `cost[threads]` seconds (changeable)."""

    def __init__(self, cost: dict[int, float], **kw) -> None:
        self.now, self.cost, self.set_calls = 0.0, cost, []
        self.gov = ThreadGovernor(
            2, clock=lambda: self.now, set_threads=self.set_calls.append, **kw
        )

    def run(self, steps: int, key: object = 1) -> list[int]:
        """The count each step ran with."""
        used = []
        for _ in range(steps):
            self.gov.step(key)
            used.append(self.gov.threads)
            self.now += self.cost[self.gov.threads] * (1 if key is not None else 10)
        return used


def test_switches_to_one_thread_when_it_is_faster() -> None:
    steps = FakeSteps({2: 0.100, 1: 0.025})  # a busy core: both threads wait for each other
    used = steps.run(60)
    assert used[:5] == [2] * 5  # four steps filed at today's count, then the trial
    assert steps.gov.chosen == 1 and used[-20:].count(1) >= 18


def test_keeps_every_core_when_one_thread_is_slower() -> None:
    steps = FakeSteps({2: 0.018, 1: 0.025})  # idle cores: two threads win
    used = steps.run(400)
    assert steps.gov.chosen == 2
    assert steps.gov.gap > steps.gov.min_gap  # the choice stood: probes come more rarely
    assert used.count(1) < 0.1 * len(used)  # the trials are few


def test_follows_a_load_that_comes_and_goes() -> None:
    steps = FakeSteps({2: 0.018, 1: 0.025}, max_gap=32)
    steps.run(100)
    assert steps.gov.chosen == 2
    steps.cost = {2: 0.100, 1: 0.025}  # another process takes a core
    steps.run(100)
    assert steps.gov.chosen == 1
    steps.cost = {2: 0.018, 1: 0.025}  # and leaves
    steps.run(100)
    assert steps.gov.chosen == 2


def test_slower_steps_bring_the_next_trial_forward() -> None:
    steps = FakeSteps({2: 0.018, 1: 0.025})
    steps.run(200)
    assert steps.gov.chosen == 2 and steps.gov.due > 20  # the next trial is far off
    steps.cost = {2: 0.100, 1: 0.025}  # a core is taken: the steps are 5 times slower
    used = steps.run(12)
    assert used[-1] == 1 and steps.gov.chosen == 1  # four slow steps filed, then the trial


def test_a_small_difference_changes_nothing() -> None:
    steps = FakeSteps({2: 0.020, 1: 0.019})  # within the margin: the choice stands
    steps.run(200)
    assert steps.gov.chosen == 2


def test_a_plainly_slower_trial_ends_at_its_first_step() -> None:
    steps = FakeSteps({2: 0.100, 1: 0.025})
    steps.run(30)
    assert steps.gov.chosen == 1
    steps.gov.due = 1  # a trial of both threads once four steps are filed
    used = steps.run(6)
    assert used == [1, 1, 1, 2, 2, 1]  # its first filed step (after the waking one) ends it
    assert steps.gov.chosen == 1 and not steps.gov.times[2]


def test_prompts_use_every_core_and_are_not_filed() -> None:
    steps = FakeSteps({2: 0.100, 1: 0.025})
    steps.run(30)
    assert steps.gov.chosen == 1
    assert steps.run(1, key=None) == [2]  # a prefill step, 10 decode steps long
    assert steps.run(6) == [1] * 6  # the first wakes no thread, but follows a change
    assert list(steps.gov.times[1]) == [pytest.approx(0.025)] * 4  # neither side of it filed


def test_another_batch_size_starts_the_times_afresh() -> None:
    steps = FakeSteps({2: 0.100, 1: 0.025})
    for size in range(1, 30):  # a new shape every step: never two comparable times
        steps.run(1, key=size)
    assert steps.gov.chosen == 2 and 1 not in steps.set_calls
    assert not steps.gov.times[2]


def test_the_first_step_after_a_change_is_not_filed() -> None:
    steps = FakeSteps({2: 0.100, 1: 0.025})
    steps.run(6)  # the sixth step starts the trial of one thread (4 steps filed before)
    assert steps.gov.trying == 1 and not steps.gov.times[1]
    steps.run(1)
    assert not steps.gov.times[1]  # the waking step
    steps.run(1)
    assert list(steps.gov.times[1]) == [pytest.approx(0.025)]


def test_the_path_governs_eager_decode_steps_only() -> None:
    """Prompts, and decode steps of the compiled decoder (whose graph holds its count), are
    not governed: they run on every core."""
    keys: list[object] = []
    path = GovernedThreads(SimpleNamespace(step=keys.append))  # type: ignore[arg-type]
    from minisgl.ext.cpu.torch_compile import OneRequestCompiled

    decoder = object()
    compiled = object.__new__(OneRequestCompiled)  # torch.compile's, for one request
    engine = SimpleNamespace(model=SimpleNamespace(model=decoder))
    for is_decode, size, runs in [(True, 3, decoder), (False, 3, decoder), (True, 1, compiled)]:
        engine.decoder = lambda batch, runs=runs: runs
        batch = SimpleNamespace(is_decode=is_decode, size=size)
        assert path.forward(engine, batch, [True] * size, False) is None  # it runs no step
    assert keys == [3, None, None]


def scheduler(device: str = "cpu", cpu_threads: int = 0) -> SimpleNamespace:
    config = SimpleNamespace(extras={"cpu": CpuOptions(cpu_threads=cpu_threads)})
    engine = SimpleNamespace(device=torch.device(device), config=config)
    return SimpleNamespace(engine=engine, config=config)


def test_an_explicit_count_is_never_governed(monkeypatch) -> None:
    monkeypatch.setattr(threads, "affinity_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert isinstance(governed_threads(scheduler()), GovernedThreads)
    assert governed_threads(scheduler(cpu_threads=2)) is None  # --cpu-threads 2
    assert governed_threads(scheduler("meta")) is None  # not a cpu engine
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert governed_threads(scheduler()) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "affinity_cores", lambda: 1)
    assert governed_threads(scheduler()) is None  # one core: nothing to choose


def test_the_starting_count(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(threads, "affinity_cores", lambda: 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads.set_cpu_threads(scheduler().engine.config, every_core=True)
    assert calls == []  # the user's OMP_NUM_THREADS stands
    threads.set_cpu_threads(scheduler(cpu_threads=5).engine.config, every_core=False)
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads.set_cpu_threads(scheduler().engine.config, every_core=True)
    threads.set_cpu_threads(scheduler().engine.config, every_core=False)  # e.g. on cuda
    assert calls == [5, 3]


def test_the_flag_is_checked_and_needs_the_extension(core_alone) -> None:
    with pytest.raises(ExtensionMissing) as info:
        LLM.configs("model", {"cpu_threads": 2})
    assert (info.value.what, info.value.extension) == ("cpu_threads", "cpu")


def test_the_flag_and_the_keyword() -> None:
    from minisgl.server.args import parse_args

    assert parse_args(["--cpu-threads", "3"]).scheduler.extras["cpu"].cpu_threads == 3
    assert LLM.configs("model", {"cpu_threads": 2})[1].extras["cpu"].cpu_threads == 2
    with pytest.raises(OptionError, match="invalid cpu_threads -1") as info:
        LLM.configs("model", {"cpu_threads": -1})
    assert info.value.name == "cpu_threads"


def test_greedy_tokens_do_not_depend_on_the_count(model_dirs, monkeypatch) -> None:
    """A governor that tries the other count every second step: the tokens stay those of one
    thread, and both counts ran."""
    path, _ = model_dirs("llama")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    fixed = LLM(path, page_size=4, num_pages=64, cpu_threads=1)
    want = [o["token_ids"] for o in fixed.generate(prompts, params, use_tqdm=False)]
    fixed.shutdown()
    used: list[int] = []

    def governor(cores: int) -> ThreadGovernor:
        def set_threads(n: int) -> None:
            used.append(n)
            torch.set_num_threads(n)

        return ThreadGovernor(cores, set_threads=set_threads, probe=1, min_gap=1, max_gap=1)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "affinity_cores", lambda: 2)
    monkeypatch.setattr(threads, "ThreadGovernor", governor)
    before = torch.get_num_threads()
    try:
        llm = LLM(path, page_size=4, num_pages=64)
        for prompt, tokens in zip(prompts, want):  # one at a time: steps of one decode
            assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == tokens
        llm.shutdown()
    finally:
        torch.set_num_threads(before)
    assert {1, 2} <= set(used)
