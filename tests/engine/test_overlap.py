"""Overlap scheduling (the next step is built while the current one runs) must not change any
output: greedy and seeded sampling, stop tokens, length limits and preemption, on vs off."""

import random

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.scheduler import PLACEHOLDER


def run(path: str, monkeypatch, overlap: bool, **kwargs) -> tuple[list, int]:
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
    llm = LLM(path, page_size=4, max_prefill_tokens=24, **kwargs)
    assert llm.scheduler.overlap is overlap
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(3, 30))] for _ in range(12)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 14),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            stop_token_ids=[rng.randrange(2, 500) for _ in range(40)],  # some stop early
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.scheduler.has_work
    llm.scheduler.check_no_leak()
    llm.shutdown()
    outputs = [(o["token_ids"], o["finish_reason"]) for o in outs]
    return outputs, llm.scheduler.planner.num_preemptions


@pytest.mark.parametrize("num_pages", [256, 14])
def test_overlap_on_off_identical(model_dirs, monkeypatch, num_pages):
    path, _ = model_dirs("qwen3")
    on, preempted = run(path, monkeypatch, True, num_pages=num_pages)
    off, _ = run(path, monkeypatch, False, num_pages=num_pages)
    assert on == off
    assert all(PLACEHOLDER not in ids for ids, _ in on)
    assert any(reason == "stop" for _, reason in on) and any(r == "length" for _, r in on)
    if num_pages == 14:
        assert preempted > 0
