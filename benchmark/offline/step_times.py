"""bench.py --step-times: where a run is bound by the host. Each scheduler step's host time to
launch it (`Scheduler._launch`: the forward, the sampling and the host state) and, on CUDA, the
GPU time from its first launch to its last and the GPU's idle time before it, summed by kind of
step: prompt steps (prefill, or mixed with decode rows) and decode steps by batch size. A step
whose GPU time is about its host time waited for its launches; idle before a step is the GPU
waiting for the host between steps. CUDA events cost a few microseconds a step, where the
profilers (`--profile`, `timeline.py`) slow the host itself. Session 61 found with it that the
default workload is GPU-bound: 0.04 s of idle in 5.06 s (docs/benchmarks.md)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

Step = tuple[str, float, Any, Any]  # kind, host seconds, CUDA events before and after (or None)


def kind(batch: Any) -> str:
    """A step's group: prefill, mixed (prompt tokens with decode rows) or decode by rows."""
    if not batch.is_decode:
        return "mixed" if batch.num_decodes else "prefill"
    low = 1 << (batch.size.bit_length() - 1)  # rows in [low, 2 low)
    return "decode 1 row" if low == 1 else f"decode {low}-{2 * low - 1} rows"


@contextmanager
def recorded(steps: list[Step]) -> Iterator[None]:
    """Every step launched inside, appended to `steps`."""
    import torch

    from minisgl.scheduler.scheduler import Scheduler

    cuda, launch = torch.cuda.is_available(), Scheduler._launch

    def event() -> Any:
        if not cuda:
            return None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def timed(self: Any, batch: Any) -> Any:
        before, start = event(), time.perf_counter()
        result = launch(self, batch)
        steps.append((kind(batch), time.perf_counter() - start, before, event()))
        return result

    Scheduler._launch = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler._launch = launch  # type: ignore[method-assign]


def summary(runs: list[list[Step]]) -> list[str]:
    """Lines: per kind of step, its count and host / GPU milliseconds a step and the GPU's idle
    seconds before those steps (each run's first step has none counted); then the totals."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for steps in runs:
        if steps and steps[-1][3] is not None:
            steps[-1][3].synchronize()  # the run's last event: every one before it has its time
        previous = None
        for name, host, before, after in steps:
            group = groups[name]
            group[0] += 1
            group[1] += host
            if before is not None:
                group[2] += before.elapsed_time(after) / 1e3
                if previous is not None:
                    group[3] += previous.elapsed_time(before) / 1e3
                previous = after
    gpu = any(before is not None for steps in runs for _, _, before, _ in steps)
    lines = [f"steps of {len(runs)} run(s): count, host ms a step" + (
        ", GPU ms a step, GPU idle before them (s)" if gpu else " (no CUDA: no GPU times)")]  # fmt: skip
    order = sorted(groups, key=lambda name: (name.startswith("decode"), len(name), name))
    for name in order:
        count, host, device, idle = groups[name]
        cells = f"{int(count)}, {host / count * 1e3:.2f}"
        if gpu:
            cells += f", {device / count * 1e3:.2f}, {idle:.3f}"
        lines.append(f"  {name}: {cells}")
    if gpu:
        idle = sum(group[3] for group in groups.values())
        lines.append(f"GPU idle between steps: {idle:.3f} s in all")
    return lines
