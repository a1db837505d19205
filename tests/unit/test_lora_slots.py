"""ext/lora's SlotManager, as KV pages are managed: adapters in device slots 1..max_loras, the
least recently used idle one evicted to the host cache, never one in use, the host cache
bounded by max_cpu_loras; a failed load changes nothing. A state machine (hypothesis) checks
the invariants after every operation against a plain model of what must hold."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minisgl.ext.lora.weights import AdapterInUse, SlotManager, SlotsBusy

NAMES = ["a", "b", "c", "d", "e", "f"]


class Disk:
    """Adapters on disk: what the manager loads and writes, counted; "bad" cannot be read."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.device: dict[int, str] = {}  # what write() put in each slot

    def load(self, name: str) -> str:
        if name == "bad":
            raise ValueError("unreadable adapter")
        self.loads.append(name)
        return f"weights of {name}"

    def write(self, slot: int, adapter: str) -> None:
        self.device[slot] = adapter.removeprefix("weights of ")


class Slots(RuleBasedStateMachine):
    @initialize(max_loras=st.integers(1, 3), extra=st.integers(0, 2))
    def start(self, max_loras: int, extra: int) -> None:
        self.disk = Disk()
        self.m = SlotManager(max_loras, max_loras + extra, self.disk.load, self.disk.write)
        self.users: dict[str, int] = {}  # the model: running requests per adapter
        self.last_use: list[str] = []  # the model: names by last acquire, oldest first

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        m = self.m
        before = (dict(m.device), list(m.host), dict(m.pins))
        was_on_device = name in m.device
        in_use = {n for n, k in self.users.items() if k > 0}
        loads = len(self.disk.loads)
        try:
            slot = m.acquire(name)
        except SlotsBusy:
            # refused only when the adapter is not resident and every slot is in use
            assert not was_on_device and len(in_use) == m.max_loras
            assert (dict(m.device), list(m.host), dict(m.pins)) == before
            return
        if was_on_device:
            assert slot == before[0][name] and len(self.disk.loads) == loads
        else:  # it came from the host cache, or from disk when not there
            assert len(self.disk.loads) == loads + (name not in before[1])
            evicted = set(before[0]) - set(m.device)
            assert len(evicted) <= 1 and not evicted & in_use
            if evicted:  # the least recently used idle one went, and stays in the host cache
                idle = [n for n in self.last_use if n in before[0] and n not in in_use]
                assert evicted == {idle[0]}
        assert self.disk.device[slot] == name
        self.users[name] = self.users.get(name, 0) + 1
        self.last_use = [n for n in self.last_use if n != name] + [name]

    @precondition(lambda self: any(self.users.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, k in self.users.items() if k > 0)))
        self.m.release(name)
        self.users[name] -= 1

    @rule(name=st.sampled_from(NAMES))
    def remove(self, name: str) -> None:
        if self.users.get(name, 0) > 0:
            with pytest.raises(AdapterInUse, match=f"'{name}' is in use"):
                self.m.remove(name)
            return
        self.m.remove(name)
        assert name not in self.m.device and name not in self.m.host
        self.last_use = [n for n in self.last_use if n != name]

    @rule()
    def bad_load_changes_nothing(self) -> None:
        before = (dict(self.m.device), list(self.m.host), dict(self.m.pins), list(self.m.free))
        with pytest.raises((ValueError, SlotsBusy)):
            self.m.acquire("bad")
        assert (dict(self.m.device), list(self.m.host), dict(self.m.pins), self.m.free) == before

    @invariant()
    def bounded_and_consistent(self) -> None:
        m = self.m
        assert len(m.device) <= m.max_loras and len(m.host) <= m.max_cpu_loras
        slots = list(m.device.values())
        assert sorted(slots + m.free) == list(range(1, m.max_loras + 1))  # each slot once
        assert set(m.device) <= set(m.host)  # what is on the device has its host copy
        for name, count in self.users.items():  # in use: resident, pinned as many times
            if count:
                assert m.pins[name] == count and name in m.device
        for name, slot in m.device.items():
            assert self.disk.device[slot] == name


TestSlots = Slots.TestCase
TestSlots.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_release_without_use_and_bad_sizes_are_errors():
    m = SlotManager(1, 1, lambda n: n, lambda s, a: None)
    with pytest.raises(ValueError, match="'a' is not in use"):
        m.release("a")
    assert m.acquire("a") == 1
    with pytest.raises(SlotsBusy, match="all 1 LoRA slots"):
        m.acquire("b")
    m.release("a")
    assert m.acquire("b") == 1 and "a" not in m.host  # a: evicted, and beyond max_cpu_loras
    with pytest.raises(ValueError, match="max_cpu_loras"):
        SlotManager(2, 1, lambda n: n, lambda s, a: None)
    with pytest.raises(ValueError, match="max_loras"):
        SlotManager(0, 1, lambda n: n, lambda s, a: None)
