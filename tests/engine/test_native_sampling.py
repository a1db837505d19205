"""The CPU engine's sampler (ext/cpu's sampling.py and sample.cpp, through `kernel.CPU_OPS`):
the torch path's tokens for the same logits, temperatures, seeds and steps (the same noise; logs
within float rounding), greedy rows exact, ties to the first token, any vocabulary size
(chunks and tails), the same ids on one thread and two, the table write; with top-k, top-p and
min-p the torch path's tokens through each pass (256, 4,096, the whole row) and ties to the
lower token whatever the batch; and a CPU engine sampling through it with the torch path's
tokens."""

from __future__ import annotations

import pytest
import torch

from minisgl import kernel
from minisgl.engine.sample import Filters, sample
from minisgl.ext.cpu import native, sampling

pytestmark = pytest.mark.skipif(
    not native.float32_kernels(), reason="needs the AVX512 build of the native kernels"
)


@pytest.fixture
def torch_path(monkeypatch):
    """`sample` on its torch path (a CPU engine built earlier in this process registered ext/cpu's
    sampler)."""
    monkeypatch.setattr(kernel, "CPU_OPS", {})


def draws(rows: int, vocab: int, dtype: torch.dtype, seed: int):
    """Logits [rows, vocab] of spread-out scores, temperatures (row 0 greedy), seeds up to
    2**62 and steps up to 2**31."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05
    temperature[0] = 0.0
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    steps = torch.randint(0, 2**31 - 1, (rows,), generator=gen)
    return logits, temperature, seeds, steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_torch_paths_tokens(dtype, torch_path) -> None:
    agree = total = 0
    for i, vocab in enumerate((1, 15, 16, 17, 8191, 8192, 8193, 49_152, 151_936)):
        logits, temperature, seeds, steps = draws(6, vocab, dtype, seed=i)
        want = sample(logits, temperature, seeds, steps)
        got = sampling.gumbel_argmax(logits, temperature, seeds, steps)
        assert got.dtype == torch.int64 and got[0] == want[0]  # greedy: exact
        agree, total = agree + int((got == want).sum()), total + len(want)
    # a draw differs only where two scores are within a few ulp (the logs' rounding)
    assert agree >= total - 1, f"{agree} of {total}"


def test_ties_go_to_the_first_token_and_threads_do_not_matter() -> None:
    logits = torch.zeros(3, 20_000)
    logits[:, [5, 17_000]] = 1.0  # two maxima, in two chunks of the row
    logits[2] = float("-inf")
    temperature, seeds, steps = torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3)
    assert sampling.gumbel_argmax(logits, temperature, seeds, steps).tolist() == [5, 5, 0]
    logits, temperature, seeds, steps = draws(5, 30_000, torch.bfloat16, seed=9)
    before = torch.get_num_threads()
    try:
        ids = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ids.append(sampling.gumbel_argmax(logits, temperature, seeds, steps))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ids[0], ids[1])


def test_the_ids_go_into_the_table_and_bad_logits_are_refused() -> None:
    logits, temperature, seeds, steps = draws(3, 100, torch.float32, seed=3)
    table, rows, at = torch.zeros(4, 10, dtype=torch.int32), torch.tensor([2, 0, 3]), steps % 10
    ids = sampling.gumbel_argmax(logits, temperature, seeds, at, into=(table, rows))
    assert torch.equal(table[rows, at], ids.to(torch.int32))
    with pytest.raises(RuntimeError, match="logits must be"):
        sampling.gumbel_argmax(logits.double(), temperature, seeds, steps)
    with pytest.raises(RuntimeError, match="one value a row"):
        sampling.gumbel_argmax(logits, temperature[:2], seeds, steps)


def filters(rows: int, vocab: int, seed: int) -> Filters:
    gen = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, vocab + 1, (rows,), generator=gen)
    top_p, min_p = torch.rand(rows, generator=gen), torch.rand(rows, generator=gen) * 0.2
    top_k[0], top_p[1 % rows], min_p[1 % rows] = vocab, 1.0, 0.0  # a row of top-k alone
    return Filters(top_k, top_p, min_p)


@pytest.mark.parametrize("spread", [8.0, 2.0, 0.05])  # nuclei inside 256, 4,096, the whole row
def test_filtered_rows_draw_the_torch_paths_tokens(spread, torch_path) -> None:
    agree = total = 0
    for i, vocab in enumerate((3, 300, 5000, 49_152)):
        logits, temperature, seeds, steps = draws(5, vocab, torch.float32, seed=i)
        logits = logits / 4 * spread  # float32 logits: no two probabilities tie
        args = filters(5, vocab, seed=i)
        want = sample(logits, temperature, seeds, steps, args)
        got = sampling.gumbel_argmax(logits, temperature, seeds, steps, filters=args)
        agree, total = agree + int((got == want).sum()), total + len(want)
        kept = sampling.filtered_log_probs(logits, temperature, args) > float("-inf")
        assert kept[torch.arange(5), got].all() and kept.any(-1).all()
    assert agree >= total - 1, f"{agree} of {total}"


def test_filtered_ties_go_to_the_lower_token_in_any_batch() -> None:
    """Equal logits at the top-k cut: the lower ids stay, whether the batch's other row needs
    the whole row (a flat one with top-p 1) or not."""
    tied = torch.full((1, 10_000), -5.0)
    tied[0, [9000, 7, 3000, 12]] = 2.0  # four equal maxima; top-k 2 keeps 7 and 12
    flat = torch.zeros(1, 10_000)
    args = Filters(torch.tensor([2, 10_000]), torch.tensor([1.0, 1.0]), torch.zeros(2))
    alone = Filters(args.top_k[:1], args.top_p[:1], args.min_p[:1])
    for logits, cut in ((tied, alone), (torch.cat([tied, flat]), args)):
        kept = sampling.filtered_log_probs(logits, torch.ones(len(logits)), cut)[0]
        assert (kept > float("-inf")).nonzero().flatten().tolist() == [7, 12]


def test_a_cpu_engine_samples_through_it(model_dirs) -> None:
    """The engine registers the sampler; seeded draws at temperature 1, plain and filtered,
    are the torch path's."""
    from minisgl import LLM, SamplingParams

    path, _ = model_dirs("llama")
    llm = LLM(path, dtype="bfloat16", page_size=4, num_pages=64)
    assert kernel.CPU_OPS.get("sampling") is sampling
    plain = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(**plain, seed=s) for s in range(3)]
    params.append(SamplingParams(**plain, seed=3, top_k=20, top_p=0.9, min_p=0.01))
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10]]
    native_ids = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    del kernel.CPU_OPS["sampling"]
    try:
        torch_ids = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        kernel.CPU_OPS["sampling"] = sampling
    assert native_ids == torch_ids and len({tuple(ids) for ids in native_ids}) > 1
