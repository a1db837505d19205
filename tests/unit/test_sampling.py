import pytest
import torch

from minisgl import LLM, SamplingParams, kernel
from minisgl.core import Req
from minisgl.engine.sample import sample, uniform_noise
from minisgl.ext.sampling.adjust import AdjustTable, adjust_logits
from support.invariants import check_no_leak
from support.sampling import sampling_args


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The core's own sampler: a CPU engine built earlier in this process may have registered
    ext/cpu's in `kernel.CPU_OPS` (tests/engine/test_native_sampling.py tests that one)."""
    monkeypatch.setattr(kernel, "CPU_OPS", {})


def args_for(params: list[SamplingParams], vocab: int, steps: list[int] | None = None):
    reqs = [Req([1] * (s or 1), s or 1, p, 100) for p, s in zip(params, steps or [1] * len(params))]
    return sampling_args(reqs, vocab, torch.device("cpu"))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    args = args_for([SamplingParams()] * 5, 50)
    assert not args[0].any()  # every temperature 0
    assert torch.equal(sample(logits, *args), logits.argmax(-1))


def test_noise_is_uniform_and_deterministic():
    seed, step = torch.tensor([1, 1, 2]), torch.tensor([5, 5, 5])
    u = uniform_noise(seed, step, 20000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u[2].float(), bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 200


def _noise_by_the_formula(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """The counter hash as the GPU kernel and earlier releases define it: uint32 arithmetic
    held in int64, every product reduced mod 2**32 (a seeded request's draws depend on it)."""

    def mix(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        return (x >> 16) ^ x

    row = mix((mix(seed & 0xFFFFFFFF) ^ (step * 0x9E3779B1 & 0xFFFFFFFF)) & 0xFFFFFFFF)
    token = torch.arange(vocab) * 0x85EBCA6B & 0xFFFFFFFF
    return ((mix((row[:, None] ^ token[None, :]) & 0xFFFFFFFF) >> 9).float() + 0.5) * 2.0**-23


def test_noise_is_the_counter_hash_bit_for_bit():
    """uniform_noise computes in int32 (wrapping products, masked shifts) for speed: the same
    bits as the formula for any seed (up to 2**62), step and vocabulary."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 50_000):
        seed = torch.cat(
            [
                torch.tensor([0, 2**31, 2**32 - 1, 2**62]),
                torch.randint(0, 2**62, (4,), generator=gen),
            ]
        )
        step = torch.cat(
            [torch.tensor([0, 2**31 - 1, 1, 5]), torch.randint(0, 2**31, (4,), generator=gen)]
        )
        assert torch.equal(
            uniform_noise(seed, step, vocab), _noise_by_the_formula(seed, step, vocab)
        )


def test_temperature_sampling_follows_softmax():
    vocab, n = 8, 4000
    logits = torch.randn(vocab).repeat(n, 1)
    params = [SamplingParams(temperature=0.7, seed=3)] * n
    args = args_for(params, vocab, steps=list(range(1, n + 1)))  # a fresh draw per step
    counts = torch.bincount(sample(logits, *args), minlength=vocab).float() / n
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (counts - expected).abs().max() < 0.03


def test_filters():
    vocab, n = 10, 2000
    logits = torch.arange(vocab, dtype=torch.float32).repeat(n, 1) * 0.3  # token 9 most likely
    steps = list(range(1, n + 1))
    top_k = sample(logits, *args_for([SamplingParams(temperature=1.0, top_k=3)] * n, vocab, steps))
    assert set(top_k.tolist()) == {7, 8, 9}
    probs = torch.softmax(logits[0], -1).sort(descending=True).values
    top_p = float(probs[:2].sum()) - 1e-3  # keeps exactly the two most likely tokens
    out = sample(
        logits, *args_for([SamplingParams(temperature=1.0, top_p=top_p)] * n, vocab, steps)
    )
    assert set(out.tolist()) == {8, 9}
    ratio = float(probs[3] / probs[0]) - 1e-4  # tokens 6..9 survive
    out = sample(
        logits, *args_for([SamplingParams(temperature=1.0, min_p=ratio)] * n, vocab, steps)
    )
    assert set(out.tolist()) == {6, 7, 8, 9}


def test_ties_at_a_cut_keep_the_lower_token_ids():
    """A third of the tokens share the largest probability; top-k 4 keeps the four lowest ids
    in every row (an unstable sort, torch's default from 100 values, keeps others)."""
    vocab, n = 300, 400
    logits = torch.zeros(n, vocab)
    logits[:, 1::3] = 5.0
    steps = list(range(1, n + 1))
    out = sample(logits, *args_for([SamplingParams(temperature=1.0, top_k=4)] * n, vocab, steps))
    assert set(out.tolist()) == {1, 4, 7, 10}


def test_mixed_batch_rows_are_independent():
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, seed=7, top_p=0.5),
    ]
    out = sample(logits, *args_for(params, 30))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    alone = sample(logits[1:2], *args_for(params[1:2], 30))
    assert out[1] == alone[0]


def test_seeded_generation_is_reproducible_across_batches(model_dirs):
    path = model_dirs("qwen3")[0]
    llm = LLM(path, page_size=4, num_pages=256)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    prompt = [5, 6, 7, 8, 9]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = [SamplingParams(temperature=0.8, max_tokens=12)] * 3
    mixed = llm.generate(
        [[1, 2], prompt, [3] * 7, [4] * 11], [others[0], seeded, *others[1:]], use_tqdm=False
    )
    assert mixed[1]["token_ids"] == alone
    unseeded = llm.generate(
        [prompt] * 4, SamplingParams(temperature=1.0, max_tokens=12), use_tqdm=False
    )
    assert len({tuple(o["token_ids"]) for o in unseeded}) > 1
    check_no_leak(llm.scheduler)


def test_adjust_logits_against_the_plain_formulas():
    """Row 0 plain (untouched), row 1 all adjustments, row 2 bias only; prompt [1, 2, 2],
    output [2, 3, 3] so far; EOS 4 and stop id 5 are held back by min_tokens."""
    vocab = 8
    logits = torch.randn(3, vocab)
    full = SamplingParams(
        frequency_penalty=0.5,
        presence_penalty=0.25,
        repetition_penalty=2.0,
        logit_bias={0: 3.0, 4: 1.0},
        min_tokens=4,
        stop_token_ids=[5],
    )
    params = [SamplingParams(), full, SamplingParams(logit_bias={7: -100.0})]
    reqs = [Req([1, 2, 2, 2, 3, 3], 3, p, 100) for p in params]
    cpu = torch.device("cpu")
    table = AdjustTable(4, cpu)
    table.write(3, Req([6], 1, full, 100), {4})  # another request's row, never read here
    token_table = torch.full((4, 16), 6, dtype=torch.int32)
    for row, req in enumerate(reqs):
        table.write(row, req, {4})
        token_table[row, :6] = torch.tensor(req.tokens)
    rows, kv_lens = torch.tensor([0, 1, 2]), torch.tensor([6, 6, 6])  # sampling position 6
    got = logits.clone()
    adjust_logits(got, table, rows, kv_lens, token_table, [(1, 6)])
    want = logits.clone()
    want[1, 0] += 3.0
    want[1, [4, 5]] = -float("inf")
    for t in (1, 2, 3):  # seen in the prompt or the output
        x = want[1, t]
        want[1, t] = x / 2.0 if x > 0 else x * 2.0
    want[1, 2] -= 0.5 * 1 + 0.25
    want[1, 3] -= 0.5 * 2 + 0.25
    want[2, 7] -= 100.0
    assert torch.equal(got[0], logits[0]) and torch.allclose(got, want)
    token_table[1, 6] = 3  # min_tokens reached: EOS and stop ids are free again
    again = logits.clone()
    adjust_logits(again, table, rows[1:2], torch.tensor([7]), token_table, [(1, 7)])
    assert again[0, 4] > -float("inf") and again[0, 5] > -float("inf")
    table.write(1, Req([1, 2, 2], 3, SamplingParams(), 100), {4})  # a plain request's row now
    plain = logits.clone()
    adjust_logits(plain, table, rows, kv_lens, token_table, [])
    assert torch.equal(plain[:2], logits[:2]) and 1 not in table.dirty
