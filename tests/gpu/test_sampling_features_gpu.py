"""Issue 15's sampling features on the GPU: penalties, logit_bias, min_tokens and logprobs give
the same results with CUDA graphs as eager, and a decode step where every request uses all of
them makes no host sync (torch's sync debug mode turns any into an error)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.ext.sampling.logprobs import Logprobs
from support.invariants import check_no_leak

pytestmark = pytest.mark.gpu


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def params(i: int) -> SamplingParams:
    """Every feature, varied per request; odd requests sample, even ones are greedy."""
    return SamplingParams(
        max_tokens=6 + i % 7,
        temperature=0.8 * (i % 2),
        seed=i,
        frequency_penalty=0.4 * (i % 3),
        presence_penalty=-0.3 if i % 4 == 1 else 0.5,
        repetition_penalty=1.0 + 0.2 * (i % 2),
        logit_bias={(7 * i) % 500: -100.0, (11 * i) % 500: 3.0},
        min_tokens=i % 4,
        logprobs=i % 4,
        prompt_logprobs=2 if i % 5 == 0 else None,
    )


def run(path: str, graphs: int, attn: str, dtype: str) -> list[dict]:
    llm = LLM(path, device="cuda:0", attn=attn, dtype=dtype, page_size=16, num_pages=256,
              max_prefill_tokens=64, cuda_graph_max_bs=graphs)  # fmt: skip
    try:
        assert (llm.engine.graphs is not None) == (graphs > 0)
        outs = llm.generate(prompts(20), [params(i) for i in range(20)], use_tqdm=False)
        check_no_leak(llm.scheduler)
        return outs
    finally:
        llm.shutdown()


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=1e-4) for t in a)


def test_graph_path_equals_eager_with_every_feature(model_dirs):
    path, _ = model_dirs("qwen3")
    eager = run(path, 0, "triton", "float32")
    graphs = run(path, 16, "triton", "float32")
    for e, g in zip(eager, graphs):
        assert g["token_ids"] == e["token_ids"]
        assert all(close(x, y) for x, y in zip(g["logprobs"], e["logprobs"]))
        if "prompt_logprobs" in e:
            assert all(
                x == y is None or close(x, y)
                for x, y in zip(g["prompt_logprobs"], e["prompt_logprobs"])
            )


@pytest.mark.parametrize("attn", ["triton", "fi"])
def test_decode_step_with_every_feature_has_no_host_sync(model_dirs, attn):
    if attn == "fi":
        pytest.importorskip("flashinfer")
    path, _ = model_dirs("qwen3_hd128")
    llm = LLM(path, device="cuda:0", attn=attn, page_size=16, num_pages=256, cuda_graph_max_bs=16)
    try:
        scheduler = llm.scheduler
        for i, prompt in enumerate(prompts(12)):
            p = params(i)
            p.max_tokens, p.ignore_eos = 40, True
            p.ext["logprobs"] = 5
            scheduler.add_request(scheduler.make_request(prompt, p))
        while scheduler.planner.waiting or scheduler.planner.prefilling:
            scheduler.step()
        for _ in range(3):
            scheduler.step()  # decode steps: penalty tables and graphs warm
        batch = scheduler.planner.schedule()
        assert batch is not None and batch.is_decode and batch.size == 12
        assert llm.engine.graphs is not None and llm.engine.graphs.can_run(batch)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = scheduler._launch(batch)  # forward (graph replay), adjust, sample, copies
        finally:
            torch.cuda.set_sync_debug_mode(0)
        launched.output.tokens()  # the copies (the logprobs' too) are done
        entries = Logprobs().read(batch.reqs, launched.output.results["logprobs"]) or []
        assert all(len(e[1]) == 5 for e in entries if e is not None)
        ready = scheduler.in_flight if scheduler.overlap else launched  # as step() does
        scheduler.in_flight = launched if scheduler.overlap else None
        if ready is not None:
            scheduler.pending.extend(scheduler._process(ready))
        while scheduler.has_work:
            scheduler.step()
        check_no_leak(scheduler)
    finally:
        llm.shutdown()
