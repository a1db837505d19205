"""Log-probabilities through the offline LLM against transformers' log-softmax (float32 on CPU):
sampled tokens with their top alternatives, prompt tokens (chunked prefill, a cached prefix that
must not be reused, preemption), scoring with max_tokens 0, and the raw-logits contract."""

import math

import pytest
import torch

from minisgl import LLM, SamplingParams
from support.invariants import check_no_leak

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5, 6]]
TOL = 1e-4


@pytest.fixture(scope="module")
def llama(model_dirs):
    path, hf = model_dirs("llama")
    # a small prefill budget: prompts are computed in several chunks
    return LLM(path, page_size=4, num_pages=128, max_prefill_tokens=4), hf


@torch.no_grad()
def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is the log-distribution of the token after tokens[: p + 1]."""
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check_entry(entry: dict[int, float], token: int, row: torch.Tensor, k: int) -> None:
    top = row.topk(k)
    expected = {int(i): float(v) for i, v in zip(top.indices, top.values)}
    expected[token] = float(row[token])
    assert entry.keys() == expected.keys()
    for t, lp in entry.items():
        assert math.isclose(lp, expected[t], abs_tol=TOL), (t, lp, expected[t])


def run(llm: LLM, prompts, params) -> list[dict]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.scheduler.has_work
    check_no_leak(llm.scheduler)
    return outs


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_logprobs_equal_transformers(llama, k):
    llm, hf = llama
    outs = run(llm, PROMPTS, SamplingParams(max_tokens=6, logprobs=k))
    for prompt, out in zip(PROMPTS, outs):
        assert len(out["logprobs"]) == len(out["token_ids"]) == 6
        rows = hf_logprobs(hf, prompt + out["token_ids"])[len(prompt) - 1 :]
        for entry, token, row in zip(out["logprobs"], out["token_ids"], rows):
            check_entry(entry, token, row, k)
            assert token == int(row.argmax())  # greedy: the top token


def test_logprobs_are_the_raw_distribution(llama):
    """Temperature, penalties and logit_bias change what is sampled, not the reported logprobs."""
    llm, hf = llama
    params = SamplingParams(
        max_tokens=5, temperature=0.7, seed=3, logprobs=2, frequency_penalty=1.0, logit_bias={7: 5}
    )
    (out,) = run(llm, PROMPTS[:1], params)
    rows = hf_logprobs(hf, PROMPTS[0] + out["token_ids"])[len(PROMPTS[0]) - 1 :]
    for entry, token, row in zip(out["logprobs"], out["token_ids"], rows):
        check_entry(entry, token, row, 2)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_equal_transformers(llama, max_tokens):
    llm, hf = llama
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=2)
    run(llm, PROMPTS, SamplingParams(max_tokens=2))  # cached prefixes the scoring must not reuse
    outs = run(llm, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out["token_ids"]) == max_tokens
        assert out["finish_reason"] == "length"
        scored = out["prompt_logprobs"]
        assert len(scored) == len(prompt) and scored[0] is None
        rows = hf_logprobs(hf, prompt)
        for p in range(1, len(prompt)):
            check_entry(scored[p], prompt[p], rows[p - 1], 2)


def test_mixed_batch_reports_only_what_was_asked(llama):
    llm, _ = llama
    params = [SamplingParams(max_tokens=3, logprobs=1), SamplingParams(max_tokens=3)]
    with_lp, without = run(llm, PROMPTS[:2], params)
    assert len(with_lp["logprobs"]) == 3
    assert "logprobs" not in without and "prompt_logprobs" not in without


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_refused(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_prompt_logprobs_survive_preemption(model_dirs):
    """(Last: a second LLM replaces the module's engine context.) A pool too small for all at once preempts; every prompt position is reported once."""
    path, hf = model_dirs("llama")
    llm = LLM(path, page_size=4, num_pages=12, max_prefill_tokens=8)
    prompts = [p * 2 for p in PROMPTS]
    params = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = run(llm, prompts, params)
    assert llm.scheduler.planner.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        rows = hf_logprobs(hf, prompt + out["token_ids"])
        assert len(out["prompt_logprobs"]) == len(prompt)
        for p in range(1, len(prompt)):
            check_entry(out["prompt_logprobs"][p], prompt[p], rows[p - 1], 0)
        for i, token in enumerate(out["token_ids"]):
            check_entry(out["logprobs"][i], token, rows[len(prompt) + i - 1], 0)
