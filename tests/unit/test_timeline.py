"""benchmark/offline/timeline.py: the idle-gap arithmetic on a made-up trace, and a CPU smoke
run of the script on a tiny model."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))

from timeline import idle_gaps, per_kernel  # noqa: E402


def op(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "cat": "kernel", "ts": ts, "dur": dur}


def test_busy_is_the_union_and_gaps_name_their_neighbours():
    # b overlaps a (a PDL launch), c is inside b, then 5 us of nothing before d
    ops = [op("a", 0, 4), op("b", 2, 6), op("c", 3, 1), op("d", 13, 2)]
    busy, span, gaps = idle_gaps(ops)
    assert (busy, span) == (10, 15)
    assert [(g.start, g.length, g.before, g.after) for g in gaps] == [(8, 5, "b", "d")]
    assert idle_gaps([]) == (0.0, 0.0, [])


def test_per_kernel_counts_launches_per_step_and_sorts_by_total_time():
    ops = [op("gemv", 0, 2), op("gemv", 3, 2), op("norm", 6, 1), op("gemv", 8, 2)]
    rows = per_kernel(ops, steps=2)
    assert rows == [("gemv", 1.5, 2.0), ("norm", 0.5, 1.0)]


def test_cpu_smoke_run():
    script = os.path.join(ROOT, "benchmark", "offline", "timeline.py")
    res = subprocess.run(
        [sys.executable, script, "--tiny", "--device", "cpu", "--tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "tok/s (profiled)" in res.stdout and "no device activity" in res.stdout
