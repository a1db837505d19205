"""Log-probability rows in one read of the logits: for M rows of [B, V] logits, each row's
logsumexp, the log-probability of a target id and the top-k ids with their log-probabilities.

Stage 1 splits every row into BLOCK-wide chunks, one program each: the chunk's max, its sum of
exp(x - max) and its own top k (k rounds of max-and-mask in registers), so the logits are read
once and no [M, V] float32 copy, log-softmax or sort is made. Stage 2, one program per row,
merges the chunks: the logsumexp from the (max, sum) pairs, the top k among the chunks'
candidates, and the target's logit read directly. The torch reference is
`minisgl.ext.sampling.logprobs.LogprobRows.of`.

Ties: equal values come out in ascending id order (each round takes the leftmost maximum, and
the candidates are laid out chunk by chunk); torch's topk leaves their order unspecified, so
the two may differ only in the order of exactly equal values. A row is expected to hold at
least k finite logits (raw model logits do): masked -inf entries are not deduplicated.

Imported only for CUDA tensors (and by the interpreter tests), so `import triton` stays off
the CPU path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 20  # OpenAI's top_logprobs bound; each k compiles its own unrolled variant
BLOCK = 4096  # one chunk per program: 16 float32 values a thread at 8 warps


@triton.jit
def _chunk_kernel(
    logits,  # [B, V] any float dtype, unit stride along V
    rows,  # [M] int64 rows of `logits` (HAS_ROWS), else row m is logits' row m
    stride,
    vocab,
    chunk_max,  # [M, C] float32
    chunk_sum,  # [M, C] float32: sum of exp(x - chunk max)
    cand_val,  # [M, C, K] float32: the chunk's top K values, descending
    cand_idx,  # [M, C, K] int32: their ids
    HAS_ROWS: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,  # K rounded up to a power of two
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    row = tl.load(rows + m).to(tl.int64) if HAS_ROWS else m.to(tl.int64)
    lane = tl.arange(0, BLOCK)
    offs = c * BLOCK + lane
    x = tl.load(logits + row * stride + offs, mask=offs < vocab, other=-float("inf"))
    x = x.to(tl.float32)
    top = tl.max(x, axis=0)
    safe = tl.where(top == -float("inf"), 0.0, top)  # an all -inf chunk sums to 0, not NaN
    tl.store(chunk_max + m * chunks + c, top)
    tl.store(chunk_sum + m * chunks + c, tl.sum(tl.exp(x - safe), axis=0))
    if K > 0:
        slot = tl.arange(0, KP)
        vals = tl.full([KP], -float("inf"), tl.float32)
        ids = tl.zeros([KP], dtype=tl.int32)
        for j in tl.static_range(K):
            v, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            vals = tl.where(slot == j, v, vals)
            ids = tl.where(slot == j, i, ids)
            x = tl.where(lane == i, -float("inf"), x)
        base = (m * chunks + c) * K
        tl.store(cand_val + base + slot, vals, mask=slot < K)
        tl.store(cand_idx + base + slot, c * BLOCK + ids, mask=slot < K)


@triton.jit
def _merge_kernel(
    logits,
    rows,
    stride,
    targets,  # [M] int64: the id whose log-probability `chosen` gets
    chunk_max,
    chunk_sum,
    cand_val,
    cand_idx,
    chosen,  # [M] float32
    top_ids,  # [M, K] int64
    top_vals,  # [M, K] float32
    chunks,
    HAS_ROWS: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    CP: tl.constexpr,  # chunks rounded up to a power of two
    NP: tl.constexpr,  # chunks * K rounded up to a power of two
):
    m = tl.program_id(0)
    c = tl.arange(0, CP)
    maxes = tl.load(chunk_max + m * chunks + c, mask=c < chunks, other=-float("inf"))
    sums = tl.load(chunk_sum + m * chunks + c, mask=c < chunks, other=0.0)
    top = tl.max(maxes, axis=0)
    safe = tl.where(top == -float("inf"), 0.0, top)
    lse = safe + tl.log(tl.sum(sums * tl.exp(maxes - safe), axis=0))
    row = tl.load(rows + m).to(tl.int64) if HAS_ROWS else m.to(tl.int64)
    target = tl.load(targets + m)
    tl.store(chosen + m, tl.load(logits + row * stride + target).to(tl.float32) - lse)
    if K > 0:
        n = tl.arange(0, NP)
        base = m * chunks * K
        vals = tl.load(cand_val + base + n, mask=n < chunks * K, other=-float("inf"))
        ids = tl.load(cand_idx + base + n, mask=n < chunks * K, other=0)
        slot = tl.arange(0, KP)
        out_vals = tl.zeros([KP], dtype=tl.float32)
        out_ids = tl.zeros([KP], dtype=tl.int32)
        for j in tl.static_range(K):
            v, p = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
            picked = n == p
            # the id at p: a masked sum, as a register array has no dynamic indexing
            out_ids = tl.where(slot == j, tl.sum(tl.where(picked, ids, 0), axis=0), out_ids)
            out_vals = tl.where(slot == j, v, out_vals)
            vals = tl.where(picked, -float("inf"), vals)
        tl.store(top_vals + m * K + slot, out_vals - lse, mask=slot < K)
        tl.store(top_ids + m * K + slot, out_ids.to(tl.int64), mask=slot < K)


def logprob_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    rows: torch.Tensor | None = None,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the M rows `rows` of logits [B, V] (all B rows when None) and targets [M]: the
    targets' log-probabilities [M] float32, the top-k ids [M, k] int64 and their
    log-probabilities [M, k] float32 (k <= MAX_K), as `LogprobRows.of` computes them.
    `block`: the chunk width (a power of two; tests use small ones)."""
    if not 0 <= k <= MAX_K:
        raise ValueError(f"top-k of log-probabilities must be in [0, {MAX_K}], got {k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    vocab = logits.shape[1]
    m = logits.shape[0] if rows is None else rows.shape[0]
    block = min(block, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    device, f32 = logits.device, torch.float32
    chunk_max = torch.empty(m, chunks, dtype=f32, device=device)
    chunk_sum = torch.empty(m, chunks, dtype=f32, device=device)
    cand_val = torch.empty(m, chunks, k, dtype=f32, device=device)
    cand_idx = torch.empty(m, chunks, k, dtype=torch.int32, device=device)
    chosen = torch.empty(m, dtype=f32, device=device)
    top_ids = torch.empty(m, k, dtype=torch.int64, device=device)
    top_vals = torch.empty(m, k, dtype=f32, device=device)
    if m == 0:
        return chosen, top_ids, top_vals
    has_rows, kp = rows is not None, triton.next_power_of_2(max(k, 1))
    index = rows if rows is not None else chosen  # unread without HAS_ROWS
    _chunk_kernel[(m, chunks)](
        logits, index, logits.stride(0), vocab, chunk_max, chunk_sum, cand_val, cand_idx,
        HAS_ROWS=has_rows, K=k, KP=kp, BLOCK=block, num_warps=8,
    )  # fmt: skip
    _merge_kernel[(m,)](
        logits, index, logits.stride(0), targets.contiguous(), chunk_max, chunk_sum,
        cand_val, cand_idx, chosen, top_ids, top_vals, chunks,
        HAS_ROWS=has_rows, K=k, KP=kp, CP=triton.next_power_of_2(chunks),
        NP=triton.next_power_of_2(max(chunks * k, 1)), num_warps=4,
    )  # fmt: skip
    return chosen, top_ids, top_vals
