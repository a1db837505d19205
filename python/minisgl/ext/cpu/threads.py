"""How many intra-op threads a CPU engine computes with, and when (`--cpu-threads`).

torch's OpenMP threads spin in a barrier at the end of each parallel region (libgomp: about
300,000 turns before they sleep). When another process takes one of the cores, each of a decode
step's hundreds of small regions waits for the thread that lost its core: on 2 cores a busy
second process cut SmolLM2's decode from ~65 to ~18 tok/s, where one thread alone (which the
kernel moves to the free core) keeps ~50. So by default (`--cpu-threads 0`, no OMP_NUM_THREADS)
decode steps run under a `ThreadGovernor`: the steps are timed, and the count moves between all
the cores of the affinity mask and one whenever the other is measurably faster, tried again now
and then (more rarely while the choice stands, at once when the steps slow down) so that a load
that comes and goes is followed. Prompts (prefill and mixed steps) always use every core (large
matrix products gain from them even beside a busy process), and so do the steps of the decoder
that --enable-torch-compile compiled (dynamo guards on the count: another one compiles again);
the layers compiled ahead of time (`aot.py`) are governed as eager ones (no guards; their
kernels read the count at each call, and give the same tokens on one thread and two).
An explicit count (`--cpu-threads N`, or OMP_NUM_THREADS) is kept for every step. libgomp reads
its wait policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT) when torch is imported, before any option is
known, so waiting is left as it is. The count changes no output: the quantized layers give the
same bits on one thread and two (tests/engine/test_quantized.py), as do the tiny models'
greedy tokens (tests/unit/test_cpu_threads.py)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from statistics import median
from typing import Any

import torch

from minisgl.distributed import get_tp_info
from minisgl.ext.cpu.options import cpu_options
from minisgl.extension import ForwardPath

# a tried count whose one step takes this many times the kept count's median loses at once (a
# busy core makes a step of both threads 3-6 times slower than one thread's)
SLOWER = 2.0
# the chosen count's steps this many times slower than at the last trial: try the other now
# (a step grows by a few % a 100 tokens of context: a trial then only confirms the choice)
RISE = 1.5
GROW = 4  # the gap between trials, times this each time the choice stands


def affinity_cores() -> int:
    """The cores this process may run on (its affinity mask; the CPU count off Linux)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_cpu_threads(config: Any, every_core: bool) -> None:
    """The engine's starting count: --cpu-threads N in any engine; else, with `every_core` (a
    cpu engine at TP 1), every core of the affinity mask unless OMP_NUM_THREADS chose (torch
    read it at its start)."""
    if (n := cpu_options(config).cpu_threads) > 0:
        torch.set_num_threads(n)
    elif every_core and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(affinity_cores())


class ThreadGovernor:
    """Chooses the thread count of decode steps between `cores` and 1 from their timings.

    `step(key)` is called at each step's start: `key` says what the step computes (decode steps
    of the same key, e.g. the batch size, take comparable times), None for a step it does not
    govern (it then runs on every core). The time from one decode step's start to the next
    one's is that step's time, filed under the count it ran with (not the first step after a
    change of count: it wakes the sleeping threads). The other count is tried for `probe`
    steps when `gap` decode steps have passed since the last trial, or at once when the chosen
    count's steps became `RISE` times slower than at that trial (another process took a core);
    the medians of the last `probe` steps of each decide: the other is chosen when it is faster
    by `margin`, or loses at its first step `SLOWER` times slower. The gap grows `GROW` times
    (up to `max_gap`) each time the choice stands and falls back to `min_gap` when it changes."""

    def __init__(
        self,
        cores: int,
        clock: Callable[[], float] = time.perf_counter,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        probe: int = 4,
        margin: float = 0.1,
        min_gap: int = 16,
        max_gap: int = 1024,
    ) -> None:
        assert cores > 1 and probe > 0 and 0 <= margin < 1 and 0 < min_gap <= max_gap
        self.cores, self.clock, self._set = cores, clock, set_threads
        self.probe, self.margin, self.min_gap, self.max_gap = probe, margin, min_gap, max_gap
        self.chosen = cores  # today's count until a trial says otherwise
        self.trying: int | None = None  # the count on trial
        self.gap = min_gap
        self.due = 0  # decode steps until the next trial (once `probe` steps are filed)
        self.key: Any = None  # the decode steps' key, whose times `times` holds
        self.times = self._no_times()
        self.baseline: float | None = None  # the chosen count's median at the last trial
        self.threads = 0  # the count set last (0: none yet)
        self._last: tuple[float, int] | None = None  # (start, count) of the last decode step
        self._skip = False  # the last step ran just after a change of count: not filed

    def _no_times(self) -> dict[int, deque[float]]:
        return {self.cores: deque(maxlen=self.probe), 1: deque(maxlen=self.probe)}

    def step(self, key: Any) -> None:
        now = self.clock()
        last, self._last = self._last, None
        if key is None:
            self._use(self.cores)
            return
        if key != self.key:  # another shape: earlier times do not compare
            self.key, self.times, self.trying, self.baseline = key, self._no_times(), None, None
        elif last is not None and not self._skip:
            self.times[last[1]].append(now - last[0])
        self._skip = False
        self._decide()
        self._use(self.trying or self.chosen)
        self._last = (now, self.threads)

    def _decide(self) -> None:
        kept = self.times[self.chosen]
        if self.trying is None:
            self.due -= 1
            if len(kept) == self.probe:
                risen = self.baseline is not None and median(kept) > RISE * self.baseline
                if self.due <= 0 or risen:
                    self.trying = 1 if self.chosen == self.cores else self.cores
            return
        tried = self.times[self.trying]
        if tried and tried[-1] > SLOWER * median(kept):  # plainly slower: no need for more
            better = False
        elif len(tried) == self.probe:
            better = median(tried) < median(kept) * (1 - self.margin)
        else:
            return
        if better:
            self.chosen, self.gap, self.baseline = self.trying, self.min_gap, median(tried)
        else:
            self.gap, self.baseline = min(GROW * self.gap, self.max_gap), median(kept)
        self.trying, self.due, self.times = None, self.gap, self._no_times()

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self._skip = True
            self._set(threads)
            self.threads = threads


class GovernedThreads(ForwardPath):
    """The `forward_paths` point's first path on a cpu engine with more than one core and no
    explicit count: it never runs a step, it sets the thread count each step runs with."""

    def __init__(self, governor: ThreadGovernor) -> None:
        self.governor = governor

    def forward(self, engine: Any, batch: Any, samples: list[bool], resample: bool) -> None:
        # a step of the decoder --enable-torch-compile compiled (one request's) keeps every
        # core: dynamo guards on the count, and another would compile it again mid-decode
        decoder = engine.decoder(batch)
        compiled = getattr(decoder, "holds_thread_count", False) and batch.size == 1
        self.governor.step(batch.size if batch.is_decode and not compiled else None)
        return None


def governed_threads(scheduler: Any) -> GovernedThreads | None:
    """The path for a scheduler's engine: cpu at TP 1, several cores, and no count chosen
    (--cpu-threads N, or OMP_NUM_THREADS, which the user or --dp's replicas set)."""
    if scheduler.engine.device.type != "cpu" or get_tp_info().size != 1:
        return None
    if "OMP_NUM_THREADS" in os.environ or cpu_options(scheduler.config).cpu_threads > 0:
        return None
    cores = affinity_cores()
    return GovernedThreads(ThreadGovernor(cores)) if cores > 1 else None
