"""The perf extension's prompts as CUDA-graph rows (`minisgl/ext/perf/prefill_rows.py`): a small
prefill or mixed step replayed as one decode row per position equals the eager step, and runs
only where it is cheap and exact."""

import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Req
from minisgl.engine.graph import GraphRunner
from minisgl.ext.perf import prefill_rows as perf_rows
from minisgl.ext.perf.prefill_rows import ROWS_KV_READS, prefill_rows, prefix_reads
from support.invariants import check_no_leak
from support.models import hf_greedy


@pytest.mark.parametrize("max_prefill_tokens", [8192, 8])
def test_small_prefill_steps_replay_as_decode_rows(model_dirs, monkeypatch, max_prefill_tokens):
    """Prefill and mixed steps of at most the graphs' size run as decode rows, one per
    position, through the step CUDA graphs capture (eagerly here): greedy tokens equal
    transformers', one prompt at a time (a cached prefix, a prompt longer than the graphs, which
    the planner splits to fit them) and in 8-token chunks;
    sampled tokens of a batch (mixed steps) equal the eager steps'. The rows ran, and
    disable_prefill_graphs turns them off."""
    path, hf = model_dirs("qwen3")
    real, rows = perf_rows.replay_rows, []

    def counted(engine, batch, flat, samples, resample):
        rows.append(flat.size)
        return real(engine, batch, flat, samples, resample)

    monkeypatch.setattr(perf_rows, "replay_rows", counted)
    prompts = [[2 + (7 * i + j) % 97 for j in range(3 + 5 * i)] for i in range(4)]
    prompts.append(prompts[3] + [5, 6])  # its first 18 tokens are in the radix cache
    # 50 tokens: alone, two steps of at most 32 rows (the planner caps a step at the graphs'
    # rows when what waits fits in two); with the others, a backlog: an eager step first
    prompts.append([3 + (5 * j) % 89 for j in range(50)])
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=i) for i in range(6)]
    sampled = []
    for disable in (False, True):
        rows.clear()
        llm = LLM(
            path,
            device="cpu",
            page_size=4,
            num_pages=128,
            max_prefill_tokens=max_prefill_tokens,
            disable_prefill_graphs=disable,
        )
        llm.engine.graphs = GraphRunner(llm.engine, 32, capture=False)
        for prompt in prompts:
            out = llm.generate([prompt], SamplingParams(max_tokens=5), use_tqdm=False)[0]
            assert out["token_ids"] == hf_greedy(hf, prompt, 5)
        sampled.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        check_no_leak(llm.scheduler)
        assert (rows == []) == disable and all(n <= 32 for n in rows)
        assert disable or max_prefill_tokens < 32 or 32 in rows
    assert sampled[0] == sampled[1]


def test_prefill_rows_only_for_small_plain_steps():
    """Rows replace an extend only where they are cheap and exact: up to the graphs' size, KV
    reads of the prompts' rows within the limit (a long cached prefix goes eager), no
    proposals, logprobs, grammar or logit adjustments; decode rows cost the same either way."""

    def req(cached: int, extend: int, **params) -> Req:
        tokens = list(range(cached + extend))
        return Req(
            tokens,
            len(tokens),
            SamplingParams(**params),
            8192,
            cached_len=cached,
            extend_len=extend,
        )

    assert prefix_reads(req(10, 3)) == 11 + 12 + 13
    decodes = [req(4000, 1) for _ in range(20)]  # long contexts: 80k positions, not counted
    rows = prefill_rows(Batch([*decodes, req(0, 200)], "prefill", num_decodes=20), 256)
    assert rows is not None and rows.is_decode and rows.size == 220
    assert [(r.cached_len, r.extend_len) for r in rows.reqs[20:23]] == [(0, 1), (1, 1), (2, 1)]
    assert prefill_rows(Batch([req(0, 200)], "prefill"), 199) is None  # over the graphs' size
    long_history = req(ROWS_KV_READS // 50, 50)  # a short turn after a long cached history
    assert prefill_rows(Batch([long_history], "prefill"), 256) is None
    assert prefill_rows(Batch([req(0, 20, logprobs=1)], "prefill"), 256) is None
    with_proposals = req(30, 3)  # a running request verifying two proposals
    batch = Batch([with_proposals, req(0, 20)], "prefill", num_decodes=1)
    assert prefill_rows(batch, 256) is None
