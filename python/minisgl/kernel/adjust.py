"""Logit adjustments in one launch: logit_bias, min_tokens' stop-id suppression and the
repetition / frequency / presence penalties, per row of a batch, as the torch reference
`minisgl.engine.sample.adjust_logits` applies them (same values: float32 exactly, the bias and
stop adds rounded to the logits' dtype in between as the reference's in-place adds are).

For a token id X of a row, in this order: x += bias(X); x += -inf if X is a stop id held back
by min_tokens; then, if X is among the row's tokens (prompt and output, positions before the
one being sampled) and the row has penalties: x = x / r if x > 0 else x * r (repetition),
x -= f * count + p * (count > 0), count = X's occurrences in the output.

Programs: (batch row, block of BP token positions). Each position's id is compared with every
seen position of its row (no sort): only the first occurrence of an id reads and writes its
logit, so duplicates, spread over programs, never race; the same comparisons give its output
count. Program 0 of a row also writes the bias and stop ids that no position holds. Work is
O(seen^2) comparisons per penalized row, a few microseconds on a GPU at 2k tokens.

Imported only for CUDA tensors (and by the interpreter tests), so `import triton` stays off
the CPU path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BP = 64  # token positions per program
BQ = 64  # positions compared at once


@triton.jit
def _bias_stop(x, ids, b_ids, b_vals, s_ids, s_vals, DTYPE: tl.constexpr):
    """x (float32, of `ids`) after the row's bias and stop adds, each rounded to DTYPE."""
    hit = ids[:, None] == b_ids[None, :]
    x = (x + tl.sum(tl.where(hit, b_vals[None, :], 0.0), axis=1)).to(DTYPE).to(tl.float32)
    hit = ids[:, None] == s_ids[None, :]
    return (x + tl.sum(tl.where(hit, s_vals[None, :], 0.0), axis=1)).to(DTYPE).to(tl.float32)


@triton.jit
def _seen(ids, tokens, n_seen, BQ: tl.constexpr):
    """Whether each of `ids` is among the row's first n_seen tokens."""
    found = tl.zeros(ids.shape, dtype=tl.int1)
    for start in range(0, n_seen, BQ):
        q = start + tl.arange(0, BQ)
        tok = tl.load(tokens + q, mask=q < n_seen, other=-1)
        found |= tl.max((ids[:, None] == tok[None, :]).to(tl.int32), axis=1) > 0
    return found


@triton.jit
def _adjust_kernel(
    logits,  # [B, V] float, unit stride along V; adjusted in place
    stride,
    rows,  # [B] int64: each batch row's table row
    kv_lens,  # [B] int64: the position being sampled
    penalties,  # [R, 3] float32: repetition, frequency, presence (a kernel argument named
    # `params` breaks Triton 3.6's argument binder, which has a local of that name)
    lens,  # [R, 2] int64: prompt length, end of min_tokens
    bias_ids,  # [R, NB] int64 (padded with id 0, value 0)
    bias_vals,  # [R, NB] float32
    stop_ids,  # [R, NS] int64
    stop_vals,  # [R, NS] float32 (-inf)
    tokens,  # [R, S] int32 token table
    token_stride,
    length,  # the longest penalized request; 0: no penalties this step
    NB: tl.constexpr,
    NS: tl.constexpr,
    NBP: tl.constexpr,  # NB, NS rounded up to powers of two (at least 1)
    NSP: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    dtype = logits.dtype.element_ty
    row = tl.load(rows + b).to(tl.int64)
    kv_len = tl.load(kv_lens + b)
    held = kv_len < tl.load(lens + row * 2 + 1)
    rep = tl.load(penalties + row * 3)
    freq = tl.load(penalties + row * 3 + 1)
    pres = tl.load(penalties + row * 3 + 2)
    penalized = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    n_seen = tl.where(penalized, tl.minimum(kv_len, length), 0)
    out = logits + b.to(tl.int64) * stride
    toks = tokens + row * token_stride
    # the row's entries; a table without columns (NB or NS = 0) gives one (0, 0) entry
    e = tl.arange(0, NBP)
    b_ids = tl.load(bias_ids + row * NB + e, mask=e < NB, other=0)
    b_vals = tl.load(bias_vals + row * NB + e, mask=e < NB, other=0.0)
    b_vals = b_vals.to(dtype).to(tl.float32)  # the reference adds values of the logits' dtype
    e = tl.arange(0, NSP)
    s_ids = tl.load(stop_ids + row * NS + e, mask=e < NS, other=0)
    s_vals = tl.load(stop_vals + row * NS + e, mask=e < NS, other=0.0)
    s_vals = tl.where(held, s_vals, 0.0)  # 0 once min_tokens is reached
    if j == 0:  # bias and stop ids no position holds (entries adding 0 are skipped)
        todo = (b_vals != 0.0) & ~_seen(b_ids, toks, n_seen, BQ)
        x = tl.load(out + b_ids, mask=todo).to(tl.float32)
        x = _bias_stop(x, b_ids, b_ids, b_vals, s_ids, s_vals, dtype)
        tl.store(out + b_ids, x.to(dtype), mask=todo)
        biased = (s_ids[:, None] == b_ids[None, :]) & (b_vals[None, :] != 0.0)  # done above
        todo = (s_vals != 0.0) & ~_seen(s_ids, toks, n_seen, BQ)
        todo &= tl.max(biased.to(tl.int32), axis=1) == 0
        x = tl.load(out + s_ids, mask=todo).to(tl.float32)
        x = _bias_stop(x, s_ids, b_ids, b_vals, s_ids, s_vals, dtype)
        tl.store(out + s_ids, x.to(dtype), mask=todo)
    p = j * BP + tl.arange(0, BP)
    valid = p < n_seen
    ids = tl.load(toks + p, mask=valid, other=-1)
    prompt_len = tl.load(lens + row * 2)
    first = valid
    count = tl.zeros([BP], dtype=tl.int32)
    for start in range(0, tl.where(j * BP < n_seen, n_seen, 0), BQ):
        q = start + tl.arange(0, BQ)
        tok = tl.load(toks + q, mask=q < n_seen, other=-2)
        same = ids[:, None] == tok[None, :]
        first &= tl.max((same & (q[None, :] < p[:, None])).to(tl.int32), axis=1) == 0
        count += tl.sum((same & (q[None, :] >= prompt_len)).to(tl.int32), axis=1)
    ids = ids.to(tl.int64)
    x = tl.load(out + ids, mask=first).to(tl.float32)
    x = _bias_stop(x, ids, b_ids, b_vals, s_ids, s_vals, dtype)
    x = tl.where(x > 0, tl.div_rn(x, rep), x * rep)  # div_rn: `/` rounds approximately
    x -= freq * count.to(tl.float32) + pres * (count > 0).to(tl.float32)
    tl.store(out + ids, x.to(dtype), mask=first)


def adjust_logits(
    logits: torch.Tensor,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
    params: torch.Tensor,
    lens: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor],
    stops: tuple[torch.Tensor, torch.Tensor],
    token_table: torch.Tensor,
    length: int,
) -> None:
    """Adjust logits [B, V] in place (an `AdjustTable`'s tensors; `bias`, `stops`: its (ids,
    values) pairs; `length`: the longest penalized request, 0 for none)."""
    batch = logits.shape[0]
    if batch == 0:
        return
    assert logits.stride(-1) == 1, "adjusted in place: the rows must be contiguous"
    nb, ns = bias[0].shape[1], stops[0].shape[1]
    # read by row * columns: no copy for an AdjustTable's own tensors
    (b_ids, b_vals), (s_ids, s_vals) = ((t.contiguous() for t in pair) for pair in (bias, stops))
    grid = (batch, max(1, triton.cdiv(length, BP)))
    _adjust_kernel[grid](
        logits, logits.stride(0), rows.contiguous(), kv_lens.contiguous(), params.contiguous(),
        lens.contiguous(), b_ids, b_vals, s_ids, s_vals, token_table, token_table.stride(0), length,
        NB=nb, NS=ns, NBP=triton.next_power_of_2(max(nb, 1)),
        NSP=triton.next_power_of_2(max(ns, 1)), BP=BP, BQ=BQ, num_warps=4,
        enable_fp_fusion=False,  # f * count + p * ... rounded as the reference's separate ops
    )  # fmt: skip
