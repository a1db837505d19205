"""Overlap scheduling (the next step is built while the current one runs) must not change any
output: greedy and seeded sampling, stop tokens, length limits and preemption, on vs off."""

import random

import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import Batch
from minisgl.scheduler.planner import BatchPlanner
from minisgl.scheduler.scheduler import PLACEHOLDER
from support.invariants import check_no_leak


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
    check_no_leak(llm.scheduler)
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


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("num_pages", [256, 14])
def test_mixed_steps_change_no_output(model_dirs, monkeypatch, overlap, num_pages):
    """Issue 22: decode rows beside prompt chunks in one forward (the default) give the outputs
    of separate prefill and decode steps, with preemption too; and mixed steps do happen."""
    path, _ = model_dirs("qwen3")
    mixed_steps = []
    plan = BatchPlanner.schedule

    def schedule(self: BatchPlanner) -> Batch | None:
        batch = plan(self)
        mixed_steps.append(batch is not None and batch.num_decodes > 0)
        return batch

    monkeypatch.setattr(BatchPlanner, "schedule", schedule)
    mixed, _ = run(path, monkeypatch, overlap, num_pages=num_pages, max_num_batched_tokens=20)
    assert sum(mixed_steps) >= 3
    separate, _ = run(path, monkeypatch, overlap, num_pages=num_pages, disable_mixed_steps=True)
    assert mixed == separate
