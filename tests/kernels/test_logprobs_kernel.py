"""The log-probability rows kernel (kernel/logprobs.py) against its torch reference
(`LogprobRows.of` with the fused ops off): on CUDA at Qwen3's vocabulary (151,936) in bf16 for
up to 256 rows, otherwise on small shapes under the Triton interpreter (TRITON_INTERPRET=1)
with narrow chunks, so that rows span several of them. Skipped where triton is missing."""

from __future__ import annotations

import pytest
import torch

from minisgl.ext.sampling.logprobs import LogprobRows
from support.triton_env import kernel_module, use_interpreter_on_cpu

CUDA = torch.cuda.is_available()
use_interpreter_on_cpu()  # before anything imports triton

DEVICE = torch.device("cuda" if CUDA else "cpu")
KS = [0, 1, 5, 20]
# (rows of the batch, rows asked for (None: all), vocab, chunk width)
SHAPES = (
    [(1, None, 151936, 4096), (37, 11, 151936, 4096), (256, None, 151936, 4096)]
    if CUDA
    else [(3, None, 300, 64), (5, 2, 1000, 128), (2, None, 40, 64)]
)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def on_device(test):
    """A kernel test: marked gpu where it runs on CUDA (elsewhere it runs interpreted)."""
    return pytest.mark.gpu(test) if CUDA else test


@pytest.fixture(scope="module")
def ops():
    return kernel_module("minisgl.ext.sampling.logprobs_kernel")


def problem(batch: int, asked: int | None, vocab: int, dtype: torch.dtype, seed: int):
    """Logits with ties in the top values (whole numbers in bf16's range), rows, targets."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype)
    logits[:, :: max(1, vocab // 7)] = 9.0  # equal maxima, several per chunk and across chunks
    rows = None if asked is None else torch.randperm(batch, generator=gen)[:asked]
    m = batch if rows is None else asked
    targets = torch.randint(vocab, (m,), generator=gen)
    targets[0] = 0  # a tied top id
    put = (lambda t: None) if rows is None else (lambda t: t.to(DEVICE))
    return logits.to(DEVICE), targets.to(DEVICE), put(rows)


def check(got: LogprobRows, ref: LogprobRows, logits: torch.Tensor, rows, k: int) -> None:
    """Same values (float32 rounding apart); the same ids where values differ, distinct ids
    with those values in ascending order where they tie (torch's order is unspecified)."""
    torch.testing.assert_close(got.chosen, ref.chosen, atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(got.top_values, ref.top_values, atol=2e-5, rtol=1e-6)
    assert got.top_ids.shape == ref.top_ids.shape == (len(got.chosen), k)
    assert got.top_ids.dtype == torch.int64 and got.top_values.dtype == torch.float32
    raw = (logits if rows is None else logits[rows]).float()
    ref_raw = raw.gather(1, ref.top_ids)
    torch.testing.assert_close(raw.gather(1, got.top_ids), ref_raw, atol=0, rtol=0)
    for ids in got.top_ids.tolist():
        assert len(set(ids)) == len(ids)
    tie = ref_raw[:, 1:] == ref_raw[:, :-1]
    assert bool((got.top_ids[:, 1:] > got.top_ids[:, :-1])[tie].all())


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shape", SHAPES)
def test_logprob_rows_match_torch(ops, monkeypatch, shape, k, dtype):
    batch, asked, vocab, block = shape
    logits, targets, rows = problem(batch, asked, vocab, dtype, seed=batch + k)
    chosen, ids, values = ops.logprob_rows(logits, targets, k, rows, block=block)
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")  # the reference on CUDA too
    ref = LogprobRows.of(logits, targets, k, rows)
    check(LogprobRows(chosen, ids, values), ref, logits, rows, k)


@on_device
def test_logprob_rows_dispatch(ops, monkeypatch):
    """LogprobRows.of takes the kernel on CUDA, the reference elsewhere or when disabled."""
    logits, targets, rows = problem(4, None, 300, torch.float32, seed=1)
    got = LogprobRows.of(logits, targets, 3)
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    check(got, LogprobRows.of(logits, targets, 3), logits, rows, 3)


def test_logprob_rows_refuses_a_large_k(ops):
    logits, targets, _ = problem(1, None, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match="top-k"):
        ops.logprob_rows(logits, targets, ops.MAX_K + 1)
