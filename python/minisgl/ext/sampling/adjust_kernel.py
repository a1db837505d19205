"""Logit adjustments in one launch: logit_bias, min_tokens' stop-id suppression and the
repetition / frequency / presence penalties, per row of a batch, as the torch reference
`minisgl.ext.sampling.adjust.adjust_logits` applies them (same values: float32 exactly, the bias and
stop adds rounded to the logits' dtype in between as the reference's in-place adds are).

For a token id X of a row, in this order: x += bias(X); x += -inf if X is a stop id held back
by min_tokens; then, if X is among the row's tokens (prompt and output, positions before the
one being sampled) and the row has penalties: x = x / r if x > 0 else x * r (repetition),
x -= f * count + p * (count > 0), count = X's occurrences in the output.

Penalized rows keep, by page-table row, what their positions so far hold (`firsts`: -1 at a
position whose id occurred earlier, else that id's output count; `built`: how many positions
it covers). `_track_kernel` brings it up to the positions being sampled: one new position a
decode step, compared with the row's earlier ones (linear work); a row whose positions went
back (or a fresh one, `built` 0) is rebuilt from its start. `_adjust_kernel` then touches each
distinct seen id once, at its first position, so duplicates never race. Its program 0 of a row
also writes the bias and stop ids no position holds, and records the covered positions.

Imported only for CUDA tensors (and by the interpreter tests), so `import triton` stays off
the CPU path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BP = 64  # token positions per program
BQ = 64  # positions compared at once
DECODE_BP, DECODE_BQ = 16, 512  # _track_kernel's tile when a row has few new positions


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
def _row_state(rows, kv_lens, penalties, length, b):
    """A batch row's table row, and the positions its penalties cover (0: no penalties)."""
    row = tl.load(rows + b).to(tl.int64)
    kv_len = tl.load(kv_lens + b)
    rep = tl.load(penalties + row * 3)
    freq = tl.load(penalties + row * 3 + 1)
    pres = tl.load(penalties + row * 3 + 2)
    penalized = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    return row, kv_len, tl.where(penalized, tl.minimum(kv_len, length), 0), rep, freq, pres


@triton.jit
def _track_kernel(
    rows,  # [B] int64
    kv_lens,  # [B] int64
    penalties,  # [R, 3] float32
    lens,  # [R, 2] int64: prompt length first
    tokens,  # [R, S] int32 token table
    token_stride,
    firsts,  # [R, S] int32: -1, or the output count of the id first seen there
    built,  # [R] int64: positions `firsts` covers
    length,
    BP: tl.constexpr,
    BQ: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    programs = tl.num_programs(1)
    row, _, n_seen, _, _, _ = _row_state(rows, kv_lens, penalties, length, b)
    old = tl.load(built + row)
    start = tl.where(n_seen >= old, old, 0)  # positions gone back: rebuild the row
    prompt_len = tl.load(lens + row * 2)
    toks = tokens + row * token_stride
    state = firsts + row * token_stride
    for base in range(start + j * BP, n_seen, programs * BP):  # the new positions
        p = base + tl.arange(0, BP)
        valid = p < n_seen
        ids = tl.load(toks + p, mask=valid, other=-1)
        first = valid
        count = tl.zeros([BP], dtype=tl.int32)
        kept = tl.full([BP], n_seen, tl.int64)  # the id's first position among the kept ones
        for q0 in range(0, n_seen, BQ):
            q = q0 + tl.arange(0, BQ)
            tok = tl.load(toks + q, mask=q < n_seen, other=-2)
            same = ids[:, None] == tok[None, :]
            earlier = same & (q[None, :] < p[:, None])
            first &= tl.max(earlier.to(tl.int32), axis=1) == 0
            count += tl.sum((same & (q[None, :] >= p[:, None]) & (q[None, :] >= prompt_len))
                            .to(tl.int32), axis=1)  # fmt: skip
            at = tl.where(earlier & (q[None, :] < start), q[None, :], n_seen)
            kept = tl.minimum(kept, tl.min(at, axis=1))
        tl.store(state + p, tl.where(first, count, -1), mask=valid)
        # a repeat, in the output, of an id first held by a kept position counts there
        tl.atomic_add(state + kept, 1, mask=valid & (kept < n_seen) & (p >= prompt_len))


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
    firsts,  # [R, S] int32, brought up to date by _track_kernel
    built,  # [R] int64
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
    row, kv_len, n_seen, rep, freq, pres = _row_state(rows, kv_lens, penalties, length, b)
    held = kv_len < tl.load(lens + row * 2 + 1)
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
        if n_seen > 0:
            tl.store(built + row, n_seen)
    p = j * BP + tl.arange(0, BP)
    valid = p < n_seen
    count = tl.load(firsts + row * token_stride + p, mask=valid, other=-1)
    first = count >= 0
    ids = tl.load(toks + p, mask=first, other=0).to(tl.int64)
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
    track: tuple[torch.Tensor, torch.Tensor, int],
    length: int,
) -> None:
    """Adjust logits [B, V] in place (an `AdjustTable`'s tensors; `bias`, `stops`: its (ids,
    values) pairs; `track`: its (firsts, built) state and how many new positions a row has at
    most, which only sets the parallelism; `length`: the longest penalized request, 0 for
    none)."""
    batch = logits.shape[0]
    if batch == 0:
        return
    assert logits.stride(-1) == 1, "adjusted in place: the rows must be contiguous"
    nb, ns = bias[0].shape[1], stops[0].shape[1]
    # read by row * columns: no copy for an AdjustTable's own tensors
    (b_ids, b_vals), (s_ids, s_vals) = ((t.contiguous() for t in pair) for pair in (bias, stops))
    rows, kv_lens, params, lens = (t.contiguous() for t in (rows, kv_lens, params, lens))
    firsts, built, new = track
    assert firsts.shape == token_table.shape and firsts.stride() == token_table.stride()
    if length:
        # a decode step's one new position a row: a narrow tile over long runs of earlier
        # positions (few sequential loads); chunks of new positions: square tiles
        bp, bq = (DECODE_BP, DECODE_BQ) if new <= DECODE_BP else (BP, BQ)
        _track_kernel[(batch, max(1, triton.cdiv(min(new, length), bp)))](
            rows, kv_lens, params, lens, token_table, token_table.stride(0), firsts, built,
            length, BP=bp, BQ=bq, num_warps=4,
        )  # fmt: skip
    grid = (batch, max(1, triton.cdiv(length, BP)))
    _adjust_kernel[grid](
        logits, logits.stride(0), rows, kv_lens, params, lens, b_ids, b_vals, s_ids, s_vals,
        token_table, token_table.stride(0), firsts, built, length,
        NB=nb, NS=ns, NBP=triton.next_power_of_2(max(nb, 1)),
        NSP=triton.next_power_of_2(max(ns, 1)), BP=BP, BQ=BQ, num_warps=4,
        enable_fp_fusion=False,  # f * count + p * ... rounded as the reference's separate ops
    )  # fmt: skip
