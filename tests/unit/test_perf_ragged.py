"""ext/perf's ragged fi prefill (`ragged.py`), the parts that run without a GPU: the pool slots it
gathers, against the page table read position by position, the rule that sends a batch's
prompts through the gather, and the graph size whose split count a mixed step's decode rows take
(the kernels themselves: tests/gpu/test_attention_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.context import Context
from minisgl.core import Req, SamplingParams
from minisgl.engine.graph import GraphRunner
from minisgl.ext.perf.ragged import graph_size, key_positions, worth_gathering


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    page_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 1000),
)
def test_kv_slots_read_each_position_through_its_page(lens, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    cols = max(-(-n // page_size) for n in lens)
    table = torch.randperm(cols * (len(lens) + 2), generator=gen)[: cols * (len(lens) + 2)]
    table = table.view(len(lens) + 2, cols).to(torch.int32)
    rows = torch.randperm(len(lens) + 2, generator=gen)[: len(lens)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = SimpleNamespace(page_table=table, page_size=page_size)
    got = Context.kv_slots(ctx, *key_positions(rows, indptr, sum(lens)))  # type: ignore[arg-type]
    want = [
        int(table[row, pos // page_size]) * page_size + pos % page_size
        for row, n in zip(rows.tolist(), lens)
        for pos in range(n)
    ]
    assert got.tolist() == want


def req(cached: int, extend: int) -> Req:
    r = Req([0] * (cached + extend), cached + extend, SamplingParams(), cached + extend + 1)
    r.cached_len, r.extend_len = cached, extend
    return r


def test_prompts_are_gathered_when_mostly_new():
    assert worth_gathering([req(0, 300), req(0, 1)])  # fresh prompts
    assert worth_gathering([req(12000, 4000), req(0, 14000)])  # a chunk: a prompt's rest and more
    assert worth_gathering([req(8192, 8192)])
    assert not worth_gathering([req(8000, 100)])  # a prefix-cache hit: the paged kernel
    assert not worth_gathering([])  # a step of decodes only


def test_decode_rows_take_the_size_of_the_graph_they_pad_to():
    engine = SimpleNamespace(dummy_row=0, device=torch.device("cpu"))
    sizes = GraphRunner(engine, 256, capture=False).sizes  # type: ignore[arg-type]
    for rows in range(1, 257):
        assert graph_size(rows) == min(s for s in sizes if s >= rows), rows


def test_the_prefill_benchmark_counts_the_unmasked_pairs():
    """benchmark/kernels/fi_prefill_bench.py's rate (CUDA only): 4 x head_dim FLOPs per head and
    per (query, key) pair a new token sees, its prefix and itself included."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmark", "kernels"))
    from fi_prefill_bench import causal_flops

    pieces = [(3, 2), (0, 4), (16, 1)]
    pairs = sum(1 for c, n in pieces for i in range(n) for j in range(c + n) if j <= c + i)
    assert causal_flops(pieces, heads=2, dim=8) == 4 * 8 * 2 * pairs
