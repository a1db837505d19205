"""`TokenHistogram` (the API process's per-token histogram) exposes what prometheus_client's
`Histogram` would for the same observations, a reply's n tokens taken in one call."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from minisgl.ext.serving.metrics import LATENCY_BUCKETS, TokenHistogram

values = st.sampled_from([0.0, *LATENCY_BUCKETS, 0.003, 0.0101, 7.5, 61.0, 1e6])


@given(st.lists(st.tuples(values, st.integers(1, 5)), max_size=20))
def test_token_histogram_matches_prometheus_client(observed: list[tuple[float, int]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = TokenHistogram("x_seconds", "doc", LATENCY_BUCKETS)
    ours.register(fast)
    reference = Histogram("x_seconds", "doc", buckets=LATENCY_BUCKETS, registry=theirs)
    for value, n in observed:
        fast.observe(value, n)
        for _ in range(n):
            reference.observe(value)

    def series(registry: CollectorRegistry) -> tuple[list[str], float]:
        lines = generate_latest(registry).decode().splitlines()
        total = next(float(line.split()[1]) for line in lines if line.startswith("x_seconds_sum"))
        kept = [line for line in lines if "x_seconds_created" not in line and "_sum" not in line]
        return kept, total

    (ours_lines, ours_sum), (their_lines, their_sum) = series(ours), series(theirs)
    assert ours_lines == their_lines
    assert math.isclose(ours_sum, their_sum, rel_tol=1e-9, abs_tol=1e-12)  # n * v vs n adds
