"""The CPU engine's Gumbel-max sampler (ext/cpu's sample.cpp through `kernel.CPU_OPS`): the
torch path's tokens for the same logits, temperatures, seeds and steps (the same noise; logs
within float rounding), greedy rows exact, ties to the first token, any vocabulary size
(chunks and tails), the same ids on one thread and two, the table write, and a CPU engine
sampling through it with the torch path's tokens."""

from __future__ import annotations

import pytest
import torch

from minisgl import kernel
from minisgl.engine.sample import sample
from minisgl.ext.cpu import native, sampling

pytestmark = pytest.mark.skipif(
    not native.float32_kernels(), reason="needs the AVX512 build of the native kernels"
)


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
def test_the_torch_paths_tokens(dtype) -> None:
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


def test_a_cpu_engine_samples_through_it(model_dirs) -> None:
    """The engine registers the sampler; seeded draws at temperature 1 are the torch path's."""
    from minisgl import LLM, SamplingParams

    path, _ = model_dirs("llama")
    llm = LLM(path, dtype="bfloat16", page_size=4, num_pages=64)
    assert kernel.CPU_OPS.get("sampling") is sampling
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)
    ]
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10]]
    native_ids = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    del kernel.CPU_OPS["sampling"]
    try:
        torch_ids = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        kernel.CPU_OPS["sampling"] = sampling
    assert native_ids == torch_ids and len({tuple(ids) for ids in native_ids}) > 1
