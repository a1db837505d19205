"""The fused logit-adjust kernel (kernel/adjust.py) against its torch reference
(`engine.sample.adjust_logits` with the fused ops off): on CUDA at Qwen3's vocabulary
(151,936) in bf16 for up to 256 rows and 2k-token requests, otherwise on small shapes under
the Triton interpreter (TRITON_INTERPRET=1). Rows mix penalties, logit_bias and min_tokens
with neutral ones; token ids repeat (within the prompt, the output and across both), biased
and stop ids are also seen, and min_tokens ends exactly at some rows' sampled position."""

from __future__ import annotations

import math

import pytest
import torch

from minisgl.ext.sampling.adjust import AdjustTable, adjust_logits
from support.triton_env import kernel_module, use_interpreter_on_cpu

CUDA = torch.cuda.is_available()
use_interpreter_on_cpu()  # before anything imports triton

DEVICE = torch.device("cuda" if CUDA else "cpu")
# (batch rows, vocab, longest request, distinct ids the tokens come from)
SHAPES = (
    [(1, 151936, 300, 50), (37, 151936, 2048, 3000), (256, 151936, 1100, 151936)]
    if CUDA
    else [(4, 300, 70, 12), (3, 96, 150, 40)]
)
# the interpreter casts to bfloat16 by truncation (CUDA rounds to nearest, as torch does):
# float16 (numpy's own type) checks the 16-bit roundings there
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]


def on_device(test):
    """A kernel test: marked gpu where it runs on CUDA (elsewhere it runs interpreted)."""
    return pytest.mark.gpu(test) if CUDA else test


@pytest.fixture(scope="module")
def ops():
    return kernel_module("minisgl.ext.sampling.adjust_kernel")


def _table(batch: int, vocab: int, longest: int, distinct: int, gen: torch.Generator):
    """An adjust table with more rows than the batch, the batch's rows, its sampled positions
    and a token table whose ids repeat."""
    rows_total = batch + 3
    table = AdjustTable(rows_total, torch.device("cpu"))
    rows = torch.randperm(rows_total, generator=gen)[:batch]
    kv_lens = torch.randint(2, longest + 1, (batch,), generator=gen)
    kv_lens[0] = longest
    tokens = torch.randint(distinct, (rows_total, longest + 1), generator=gen, dtype=torch.int32)
    nb, ns = 4, 3
    table.bias_ids = torch.randint(distinct, (rows_total, nb), generator=gen)
    table.bias_values = torch.randn(rows_total, nb, generator=gen) * 3
    table.stop_ids = torch.randint(distinct, (rows_total, ns), generator=gen)
    table.stop_values = torch.full((rows_total, ns), -math.inf)
    for r in range(rows_total):  # unique ids, padded with (0, 0) as AdjustTable writes them
        table.bias_ids[r] = torch.randperm(distinct, generator=gen)[:nb]
        table.stop_ids[r] = torch.randperm(distinct, generator=gen)[:ns]
    table.bias_ids[:, -1], table.bias_values[:, -1] = 0, 0.0
    table.stop_ids[:, -1], table.stop_values[:, -1] = 0, 0.0
    table.params = torch.stack(
        [torch.rand(rows_total, generator=gen) + 0.5, torch.randn(rows_total, generator=gen),
         torch.randn(rows_total, generator=gen)], dim=1,
    )  # fmt: skip
    prompt = (torch.rand(rows_total, generator=gen) * kv_lens.max()).long()
    table.lens = torch.stack([prompt, prompt + torch.randint(3, (rows_total,), generator=gen)], 1)
    for i, r in enumerate(rows.tolist()):
        table.lens[r, 0] = min(int(table.lens[r, 0]), int(kv_lens[i]))
        table.lens[r, 1] = int(kv_lens[i]) + i % 3 - 1  # held back, just ended, ended
    neutral = rows[1::3]  # no penalties, still a bias; and a row with nothing at all
    table.params[neutral] = torch.tensor([1.0, 0.0, 0.0])
    if batch > 2:
        table.bias_values[rows[2]] = 0.0
        table.stop_values[rows[2]] = 0.0
    return table, rows, kv_lens, tokens


def _to(table: AdjustTable, device: torch.device) -> AdjustTable:
    out = AdjustTable(table.params.shape[0], device)
    for name in ("params", "lens", "bias_ids", "bias_values", "stop_ids", "stop_values"):
        setattr(out, name, getattr(table, name).to(device))
    return out


def run_both(ops, shape, dtype, seed, monkeypatch, bias_cols=4, stop_cols=3):
    """(logits, the kernel's, the reference's); a table of fewer bias or stop columns."""
    batch, vocab, longest, distinct = shape
    gen = torch.Generator().manual_seed(seed)
    table, rows, kv_lens, tokens = _table(batch, vocab, longest, distinct, gen)
    table.bias_ids, table.bias_values = (
        table.bias_ids[:, :bias_cols],
        table.bias_values[:, :bias_cols],
    )
    table.stop_ids, table.stop_values = (
        table.stop_ids[:, :stop_cols],
        table.stop_values[:, :stop_cols],
    )
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype)
    table = _to(table, DEVICE)
    rows, kv_lens, tokens, logits = (t.to(DEVICE) for t in (rows, kv_lens, tokens, logits))
    pairs = _penalized(table, rows, kv_lens)
    length = max((n for _, n in pairs), default=0)
    got = logits.clone()
    bias, stops = (table.bias_ids, table.bias_values), (table.stop_ids, table.stop_values)
    track = table.track(tokens, pairs)
    ops.adjust_logits(
        got, rows, kv_lens, table.params, table.lens, bias, stops, tokens, track, length
    )
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    ref = logits.clone()
    adjust_logits(ref, table, rows, kv_lens, tokens, pairs)
    return logits, got, ref


def _penalized(table: AdjustTable, rows: torch.Tensor, kv_lens: torch.Tensor):
    """(table row, positions) of the batch's rows whose penalties are not neutral."""
    neutral = torch.tensor([1.0, 0.0, 0.0], device=table.params.device)
    penalized = (table.params[rows] != neutral).any(1)
    return [(int(r), int(n)) for r, n, p in zip(rows, kv_lens, penalized) if p]


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_adjust_matches_torch(ops, monkeypatch, shape, dtype):
    """Equal values: the kernel rounds to 16 bits where the reference's in-place adds do."""
    logits, got, ref = run_both(ops, shape, dtype, seed=shape[0], monkeypatch=monkeypatch)
    assert (ref != logits).any()  # the problem adjusts something
    assert torch.equal(got, ref)


@on_device
@pytest.mark.parametrize("columns", [(0, 0), (0, 2), (1, 0)])
def test_adjust_with_narrow_tables(ops, monkeypatch, columns):
    """Tables without bias or stop columns (no request has any), or a single column."""
    shape = (3, 151936 if CUDA else 200, 60, 25)
    _, got, ref = run_both(ops, shape, torch.float32, 5, monkeypatch, *columns)
    assert torch.equal(got, ref)


@on_device
def test_adjust_without_penalties(ops, monkeypatch):
    """length 0 (no penalized request): only bias and stop ids change."""
    batch, vocab = 3, 200 if not CUDA else 151936
    gen = torch.Generator().manual_seed(7)
    table, rows, kv_lens, tokens = _table(batch, vocab, 40, 30, gen)
    table = _to(table, DEVICE)
    rows, kv_lens, tokens = rows.to(DEVICE), kv_lens.to(DEVICE), tokens.to(DEVICE)
    logits = torch.randn(batch, vocab, generator=gen).to(DEVICE)
    got, ref = logits.clone(), logits.clone()
    bias, stops = (table.bias_ids, table.bias_values), (table.stop_ids, table.stop_values)
    track = table.track(tokens, [])
    ops.adjust_logits(got, rows, kv_lens, table.params, table.lens, bias, stops, tokens, track, 0)
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    adjust_logits(ref, table, rows, kv_lens, tokens, [])
    assert torch.equal(got, ref)
    assert int((got != logits).sum()) <= batch * 5


@on_device
def test_adjust_dispatch(ops, monkeypatch):
    """adjust_logits takes the kernel on CUDA and the reference elsewhere: equal results."""
    shape = (3, 151936 if CUDA else 128, 30, 20)
    logits, _, ref = run_both(ops, shape, torch.float32, seed=3, monkeypatch=monkeypatch)
    monkeypatch.delenv("MINISGL_DISABLE_FUSED_OPS")
    gen = torch.Generator().manual_seed(3)
    table, rows, kv_lens, tokens = _table(*shape, gen)
    table = _to(table, DEVICE)
    rows, kv_lens, tokens = rows.to(DEVICE), kv_lens.to(DEVICE), tokens.to(DEVICE)
    got = logits.clone()
    adjust_logits(got, table, rows, kv_lens, tokens, _penalized(table, rows, kv_lens))
    assert torch.equal(got, ref)


@on_device
def test_adjust_state_follows_steps(ops, monkeypatch):
    """The kernel's per-position state across steps of one table: decode steps (one new
    position), a chunk of several, a row whose positions go back (rebuilt), a row given to a
    new request (`write` resets it) and one left out of a step; each step equals the reference
    computed from scratch. Repeats of a prompt id in the output count where the prompt holds
    it first."""
    from minisgl.core import Req, SamplingParams

    batch, vocab, distinct = 4, 151936 if CUDA else 64, 9
    gen = torch.Generator().manual_seed(11)
    table, rows, kv_lens, tokens = _table(batch, vocab, 40, distinct, gen)
    table.params[rows] = torch.tensor([[1.3, 0.4, 0.2], [0.8, -0.3, 0.5]]).repeat(2, 1)
    table.lens[rows, 0] = torch.tensor([5, 0, 12, 3])
    kv_lens = torch.tensor([6, 1, 15, 9])
    table, rows, tokens = _to(table, DEVICE), rows.to(DEVICE), tokens.to(DEVICE)
    schedule = [(0, 1), (1, 1), (2, 1), (3, 1), (4, 7), (5, 1), (6, -5), (7, 1), (8, 1)]
    for step, grow in schedule:
        kv_lens = (kv_lens + grow).clamp(min=1)
        keep = (
            torch.arange(batch) != step % batch
            if step in (5, 7)
            else torch.ones(batch, dtype=torch.bool)
        )
        if step == 3:  # row 1 to a new request with new tokens: its state restarts
            new = Req([3, 3, 4], 3, SamplingParams(frequency_penalty=0.7), 100)
            table.write(int(rows[1]), new, [])
            tokens[rows[1]] = torch.randint(distinct, tokens[0].shape, generator=gen).to(DEVICE)
        step_rows, step_lens = rows[keep], kv_lens[keep].to(DEVICE)
        logits = (torch.randn(int(keep.sum()), vocab, generator=gen) * 4).to(DEVICE)
        pairs = _penalized(table, step_rows, step_lens)
        length = max(n for _, n in pairs)
        got, ref = logits.clone(), logits.clone()
        bias, stops = (table.bias_ids, table.bias_values), (table.stop_ids, table.stop_values)
        track = table.track(tokens, pairs)
        ops.adjust_logits(
            got, step_rows, step_lens, table.params, table.lens, bias, stops, tokens, track, length
        )
        with monkeypatch.context() as m:
            m.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
            adjust_logits(ref, table, step_rows, step_lens, tokens, pairs)
        assert torch.equal(got, ref), f"step {step}"
        # the step's sampled token: often one already seen
        sampled = torch.randint(distinct, (int(keep.sum()),), generator=gen, dtype=torch.int32)
        tokens[step_rows, step_lens] = sampled.to(DEVICE)
        kv_lens = torch.where(keep, kv_lens, kv_lens - grow)  # a row left out stays put
