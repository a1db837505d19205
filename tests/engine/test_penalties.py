"""Penalties, logit_bias and min_tokens through the offline LLM: greedy outputs against a plain
step-by-step reference on the transformers model (and transformers' own repetition penalty),
mixed batches, preemption, and the checks of bad values."""

from collections import Counter

import pytest
import torch

from minisgl import LLM, SamplingParams
from support.invariants import check_no_leak
from support.models import hf_greedy

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5, 6]]


@torch.no_grad()
def reference(
    hf, prompt: list[int], max_tokens: int, p: SamplingParams, eos: frozenset[int] = frozenset()
) -> list[int]:
    """Greedy, one full forward per token, with each adjustment written out plainly."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        logits = hf(torch.tensor([tokens])).logits[0, -1].float().tolist()
        for t, b in p.get("logit_bias").items():
            logits[t] += b
        if len(out) < p.get("min_tokens"):
            for t in set(p.stop_token_ids) | eos:
                logits[t] = -float("inf")
        counts, seen = Counter(out), set(tokens)
        for t in seen:
            x = logits[t]
            penalty = p.get("repetition_penalty")
            logits[t] = x / penalty if x > 0 else x * penalty
        for t, c in counts.items():
            logits[t] -= p.get("frequency_penalty") * c + p.get("presence_penalty")
        token = max(range(len(logits)), key=logits.__getitem__)
        tokens.append(token)
        out.append(token)
        if token in eos or token in p.stop_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def llama(model_dirs):
    path, hf = model_dirs("llama")
    return LLM(path, page_size=4, num_pages=128), hf


def generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(PROMPTS[: len(params)], params, use_tqdm=False)
    assert not llm.scheduler.has_work
    check_no_leak(llm.scheduler)
    return [o["token_ids"] for o in outs]


@pytest.mark.parametrize(
    "fields",
    [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=-0.5, presence_penalty=1.0),
        dict(repetition_penalty=1.8, frequency_penalty=0.5),
    ],
)
def test_penalties_match_reference(llama, fields):
    llm, hf = llama
    params = [SamplingParams(max_tokens=12, **fields) for _ in PROMPTS]
    got = generate(llm, params)
    assert got == [reference(hf, prompt, 12, params[0]) for prompt in PROMPTS]
    assert got != [hf_greedy(hf, prompt, 12) for prompt in PROMPTS], "the penalty did nothing"


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_transformers(llama, penalty):
    llm, hf = llama
    got = generate(llm, [SamplingParams(max_tokens=10, repetition_penalty=penalty)] * 3)
    for prompt, ids in zip(PROMPTS, got):
        t = torch.tensor([prompt])
        out = hf.generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=10,
            do_sample=False,
            repetition_penalty=penalty,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert ids == out[0, len(prompt) :].tolist()


def test_logit_bias_removes_and_forces_tokens(llama):
    llm, hf = llama
    prompt = PROMPTS[0]
    free = hf_greedy(hf, prompt, 6)
    banned = SamplingParams(max_tokens=6, logit_bias={free[0]: -100.0})
    out = llm.generate([prompt], banned, use_tqdm=False)[0]["token_ids"]
    assert free[0] not in out[:1] and out == reference(hf, prompt, 6, banned)
    forced = SamplingParams(max_tokens=4, logit_bias={str(7): 100})  # type: ignore[dict-item]
    assert forced.get("logit_bias") == {7: 100.0}  # JSON keys arrive as strings
    assert llm.generate([prompt], forced, use_tqdm=False)[0]["token_ids"] == [7] * 4


def test_min_tokens_holds_back_eos_and_stop_ids(llama):
    llm, hf = llama
    prompt = PROMPTS[0]
    free = hf_greedy(hf, prompt, 12)
    eos = free[2]
    llm.scheduler.eos_token_ids = llm.scheduler.planner.eos_token_ids = {eos}
    try:
        plain = llm.generate([prompt], SamplingParams(max_tokens=12), use_tqdm=False)[0]
        assert plain["token_ids"] == free[: free.index(eos) + 1]
        for params in [
            SamplingParams(max_tokens=12, min_tokens=5),
            SamplingParams(max_tokens=12, min_tokens=4, stop_token_ids=[free[0], free[1]]),
        ]:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            want = reference(hf, prompt, 12, params, frozenset({eos}))
            assert out["token_ids"] == want and len(want) > params.get("min_tokens")
            assert eos not in want[: params.get("min_tokens")]
            assert out["finish_reason"] == ("stop" if len(want) < 12 else "length")
    finally:
        llm.scheduler.eos_token_ids = llm.scheduler.planner.eos_token_ids = set()


def test_mixed_batch_leaves_plain_requests_alone(llama):
    llm, hf = llama
    plain = SamplingParams(max_tokens=10)
    solo = [llm.generate([p], plain, use_tqdm=False)[0]["token_ids"] for p in PROMPTS]
    penalized = SamplingParams(max_tokens=10, frequency_penalty=1.0, repetition_penalty=1.3)
    biased = SamplingParams(max_tokens=10, logit_bias={solo[2][0]: -100.0}, min_tokens=2)
    got = generate(llm, [plain, penalized, biased])
    assert got[0] == solo[0]
    assert got[1] == reference(hf, PROMPTS[1], 10, penalized)
    assert got[2] == reference(hf, PROMPTS[2], 10, biased)
    # a later plain request gets the rows the penalized ones used, unchanged
    assert generate(llm, [plain, plain, plain]) == solo


def test_preemption_keeps_penalty_outputs(model_dirs):
    path, hf = model_dirs("llama")
    params = [
        SamplingParams(max_tokens=24, frequency_penalty=0.8, presence_penalty=0.3),
        SamplingParams(max_tokens=24, repetition_penalty=1.5),
        SamplingParams(max_tokens=24),
    ]
    llm = LLM(path, page_size=4, num_pages=14)
    generate(llm, params[2:])
    got = generate(llm, params)
    assert llm.scheduler.planner.num_preemptions > 0, "the small pool was meant to preempt"
    assert got == [reference(hf, prompt, 24, p) for prompt, p in zip(PROMPTS, params)]
    llm.shutdown()


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-3.0), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={1: 101.0}), "logit_bias"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    ],
)
def test_bad_values_are_refused(fields, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**fields)


def test_logit_bias_ids_are_checked_against_the_vocab(llama):
    llm, _ = llama
    vocab = llm.scheduler.engine.model_config.vocab_size
    for token in (vocab, -1):
        with pytest.raises(ValueError, match="^logit_bias"):
            llm.generate([PROMPTS[0]], SamplingParams(logit_bias={token: 1.0}), use_tqdm=False)
