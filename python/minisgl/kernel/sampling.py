"""Fused Gumbel-max sampling: one pass over each row of logits, the noise generated in the
kernel from the same counter hash as `minisgl.engine.sample.uniform_noise`, so the result is
the torch path's (up to float rounding) without materialising a [B, V] noise tensor.

Imported only for CUDA tensors, so `import triton` stays off the CPU path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel import pdl
from minisgl.kernel.pdl import wait_for_previous

_MASK32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _hash32(x):
    for _ in tl.static_range(3):
        x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


@triton.jit
def _gumbel_argmax_kernel(
    logits,  # [B, V] any float dtype (read as float32)
    temperature,  # [B] float32 at stride_t, 0 = greedy
    seed,  # [B] int64
    step,  # [B] int64
    skip,  # [B] int64: nonzero = leave the row out (HAS_SKIP)
    out_val,  # [B, C] float32: best score of each vocab chunk
    out_idx,  # [B, C] int64: its token id
    vocab_size,
    chunk_size,  # a multiple of BLOCK
    stride_b,
    stride_t,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    blocks = tl.cdiv(chunk_size, BLOCK)
    if HAS_SKIP:  # a skipped row reads nothing: its chunks report (-inf, 0)
        blocks = tl.where(tl.load(skip + b) != 0, 0, blocks)
    temp = tl.load(temperature + b * stride_t)
    greedy = temp == 0.0
    safe_temp = tl.where(greedy, 1.0, temp)
    s = tl.load(seed + b).to(tl.int64)
    st = tl.load(step + b).to(tl.int64)
    row_key = _hash32((_hash32(s & _MASK32) ^ (st * 0x9E3779B1 & _MASK32)) & _MASK32)
    best_val = -float("inf")
    best_idx = tl.zeros((), dtype=tl.int64)
    chunk_start = c * chunk_size
    for block in range(blocks):
        start = chunk_start + block * BLOCK
        offs = start + tl.arange(0, BLOCK)
        valid = offs < vocab_size
        x = tl.load(logits + b * stride_b + offs, mask=valid, other=-float("inf")).to(tl.float32)
        bits = _hash32((row_key ^ (offs.to(tl.int64) * 0x85EBCA6B & _MASK32)) & _MASK32)
        u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x / safe_temp + gumbel)
        score = tl.where(valid, score, -float("inf"))
        block_max = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0, tie_break_left=True)
        better = block_max > best_val  # strict: ties keep the first index, like torch.argmax
        best_idx = tl.where(better, start + block_idx.to(tl.int64), best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(out_val + b * tl.num_programs(1) + c, best_val)
    tl.store(out_idx + b * tl.num_programs(1) + c, best_idx)


@triton.jit
def _pick_kernel(
    vals,  # [B, C] float32: each chunk's best score
    idxs,  # [B, C] int64: its token id
    out,  # [B] int64
    table,  # [rows, cols] ids, written at (table_rows[b], cols[b]) when STORE
    table_rows,  # [B] int64
    cols,  # [B] int64
    chunks,
    stride_table,
    BLOCK_C: tl.constexpr,
    STORE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    v = tl.load(vals + b * chunks + offs, mask=offs < chunks, other=-float("inf"))
    best = tl.argmax(v, axis=0, tie_break_left=True)  # the first chunk on ties
    token = tl.load(idxs + b * chunks + best)
    tl.store(out + b, token)
    if STORE:
        row, col = tl.load(table_rows + b), tl.load(cols + b)
        tl.store(table + row * stride_table + col, token.to(table.dtype.element_ty))


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    skip: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """argmax(logits / T + Gumbel noise) per row (argmax(logits) where T == 0) -> [B] int64;
    0 in the rows where `skip` [B] is nonzero, whose logits are not read: a CUDA graph's
    sampling costs nothing in a step that samples again after adjusting the logits.
    `into` = (table, rows): also write each id to table[rows[b], step[b]] (the token table,
    where a sampled id's position is its step), in the same launch that picks it."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    block = 1024
    # split each row into chunks so that a small batch still fills the GPU (one 1,024-token
    # block a program at batch 1: 149 programs for a 152k vocabulary, where 19 programs of 8
    # blocks took 12 us on an H100); a second, tiny kernel picks the best chunk
    chunks = max(1, min(triton.cdiv(vocab, block), triton.cdiv(1024, batch)))
    chunk_size = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk_size)
    best_val = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, chunks, dtype=torch.int64, device=logits.device)
    # the per-request arguments are often strided views of one [B, 3] tensor; the temperatures
    # are read at their stride (a step's are the low halves of an int64 row: no copy kernel)
    seed, step = seed.contiguous(), step.contiguous()
    launch = pdl.options(logits.device)
    _gumbel_argmax_kernel[(batch, chunks)](
        logits,
        temperature,
        seed,
        step,
        step if skip is None else skip.contiguous(),  # unread without HAS_SKIP
        best_val,
        best_idx,
        vocab,
        chunk_size,
        logits.stride(0),
        temperature.stride(0),
        HAS_SKIP=skip is not None,
        BLOCK=block,
        **launch,
        num_warps=4,
    )
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    table, rows = into if into is not None else (out, step)  # unread without STORE
    assert table.stride(-1) == 1
    _pick_kernel[(batch,)](
        best_val,
        best_idx,
        out,
        table,
        rows.contiguous(),
        step,
        chunks,
        table.stride(0),
        BLOCK_C=triton.next_power_of_2(chunks),
        STORE=into is not None,
        **launch,
        num_warps=1,
    )
    return out
