"""Fused Gumbel-max sampling: one pass over each row of logits, the noise generated in the
kernel from the same counter hash as `minisgl.engine.sample.uniform_noise`, so the result is
the torch path's (up to float rounding) without materialising a [B, V] noise tensor.

Imported only for CUDA tensors, so `import triton` stays off the CPU path."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minisgl.kernel import flags, pdl
from minisgl.kernel.pdl import wait_for_previous

_MASK32 = tl.constexpr(0xFFFFFFFF)
_LOG2E = tl.constexpr(1.4426950408889634)
# 1 - u below which log2(u) comes from its series, not lg2.approx, whose absolute error (~2**-22
# near 1) would be a large relative one in -log2(u) ~ 1 - u: the largest noise, the winners'
_SERIES_BELOW = tl.constexpr(0.0625)
_SERIES_TERMS = tl.constexpr(5)  # relative error < 2e-7 below 1/16


@triton.jit
def _hash32(x):
    """`engine/sample.py: _hash32` on uint32 values: the same bits (the reference's int32
    products wrap mod 2**32 too; its shifts are masked to be logical)."""
    for _ in tl.static_range(3):
        x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _uniform(row_mix, token_key):
    """`uniform_noise`'s u, bit for bit, from row_mix = r ^ (r >> 16) for the row key r and
    token_key = token id * 0x85EBCA6B (uint32): _hash32(r ^ token_key), its first xor-shift
    split over the xor (a shift distributes over it)."""
    x = (row_mix ^ token_key ^ (token_key >> 16)) * 0x45D9F3B
    for _ in tl.static_range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B
    # bits >> 9 for bits = (x >> 16) ^ x, as a float's mantissa in [1, 2), less 1 - 2**-24:
    # ((bits >> 9) + 0.5) * 2**-23 exactly, without an int-to-float conversion
    mantissa = ((x >> 25) ^ (x >> 9) | 0x3F800000).to(tl.float32, bitcast=True)
    return mantissa - 0.99999994039535522


@triton.jit
def _log2(x, FAST: tl.constexpr):
    # lg2.approx: one MUFU instruction (libdevice's log2f is a ~20-instruction polynomial);
    # the interpreter has no approximate log
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _log2_exponential(u, FAST: tl.constexpr):
    """log2(-log2(u)): the Gumbel noise -ln(-ln(u)) is -ln(2) * (this + log2(ln 2)), so
    argmax(logits / (T ln 2) - this) is the torch path's draw."""
    t = 1.0 - u  # exact where it is used (u >= 0.5)
    # log2(1 - t) = -t / ln 2 * (1 + t/2 + t^2/3 + ...)
    series = -_LOG2E / _SERIES_TERMS
    for k in tl.static_range(_SERIES_TERMS - 1, 0, -1):
        series = series * t - _LOG2E / k
    log2_u = tl.where(t < _SERIES_BELOW, series * t, _log2(u, FAST))
    return _log2(tl.abs(log2_u), FAST)  # |.|: a MUFU operand modifier, -x costs an add


@triton.jit
def _chunk_best(
    row, vocab_size, chunk_start, blocks, scale, row_key,
    NOISE: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """(best score, its token id) of a chunk: each lane keeps its own best over the blocks (a
    strict > keeps its first block), so the loop has no reduction; ties keep the smallest id,
    like torch.argmax (a chunk of -inf, or of no blocks, reports its first id)."""
    lanes = tl.arange(0, BLOCK)
    row_mix = row_key ^ (row_key >> 16)
    # token id * 0x85EBCA6B (mod 2**32), carried: one add a token and block
    token_key = (chunk_start + lanes).to(tl.uint32) * 0x85EBCA6B
    lane_val = tl.full((BLOCK,), -float("inf"), tl.float32)
    lane_block = tl.zeros((BLOCK,), dtype=tl.int32)
    for block in range(blocks):
        offs = chunk_start + block * BLOCK + lanes
        # -inf past the vocabulary never beats a lane's -inf start
        score = tl.load(row + offs, mask=offs < vocab_size, other=-float("inf")).to(tl.float32)
        if NOISE:
            u = _uniform(row_mix, token_key)
            token_key += BLOCK * 0x85EBCA6B & 0xFFFFFFFF
            score = score * scale - _log2_exponential(u, FAST)
        better = score > lane_val
        lane_block = tl.where(better, block, lane_block)
        lane_val = tl.where(better, score, lane_val)
    best_val = tl.max(lane_val, axis=0)
    ids = chunk_start + lane_block * BLOCK + lanes
    best_idx = tl.min(tl.where(lane_val == best_val, ids, vocab_size), axis=0)
    return best_val, best_idx


# Arguments that vary with the batch are not specialised (Triton compiles a variant per value
# pattern: 1, a multiple of 16, other): a variant first met mid-run stalls it (session 27 saw
# nine compiled during a fresh machine's first timed run, bench.py --log-compiles).
@triton.jit(do_not_specialize=["stride_t"])
def _gumbel_argmax_kernel(
    logits,  # [B, V] any float dtype (read as float32)
    temperature,  # [B] float32 at stride_t, 0 = greedy
    seed,  # [B] int64
    step,  # [B] int64
    skip,  # [B] int64: nonzero = leave the row out (HAS_SKIP)
    out_val,  # [B, C] float32: best score of each vocab chunk (log2 units, within a row)
    out_idx,  # [B, C] int64: its token id
    vocab_size,
    chunk_size,  # a multiple of BLOCK
    stride_b,
    stride_t,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST: tl.constexpr,  # approximate logs (compiled, not interpreted)
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    blocks = tl.cdiv(chunk_size, BLOCK)
    if HAS_SKIP:  # a skipped row reads nothing: its chunks report (-inf, 0)
        blocks = tl.where(tl.load(skip + b) != 0, 0, blocks)
    temp = tl.load(temperature + b * stride_t)
    s = tl.load(seed + b).to(tl.int64) & _MASK32
    st = tl.load(step + b).to(tl.int64) * 0x9E3779B1 & _MASK32
    row_key = _hash32(_hash32(s.to(tl.uint32)) ^ st.to(tl.uint32))
    row = logits + b * stride_b
    chunk_start = c * chunk_size
    if temp == 0.0:  # greedy: the logits alone, no noise to compute
        best_val, best_idx = _chunk_best(
            row, vocab_size, chunk_start, blocks, 1.0, row_key, False, BLOCK, FAST
        )
    else:  # a multiply, not a divide, in the loop
        scale = _LOG2E / temp
        best_val, best_idx = _chunk_best(
            row, vocab_size, chunk_start, blocks, scale, row_key, True, BLOCK, FAST
        )
    tl.store(out_val + b * tl.num_programs(1) + c, best_val)
    tl.store(out_idx + b * tl.num_programs(1) + c, best_idx.to(tl.int64))


@triton.jit(do_not_specialize=["chunks"])
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


@triton.jit
def _noise_kernel(u, out, n, BLOCK: tl.constexpr, FAST: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(u + offs, mask=offs < n, other=0.5)
    tl.store(out + offs, _log2_exponential(x, FAST), mask=offs < n)


def _fast_logs() -> bool:
    """Approximate logs where compiled: the interpreter has none."""
    return not flags.triton_interpret()


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    """-ln(-ln(u)) as `gumbel_argmax` computes it for float32 uniforms u in (0, 1) (from
    approximate base-2 logs on a GPU): tests hold it to the exact noise."""
    u = u.contiguous()
    log2_e = torch.empty_like(u)
    _noise_kernel[(triton.cdiv(u.numel(), 1024),)](
        u, log2_e, u.numel(), BLOCK=1024, FAST=_fast_logs(), num_warps=4
    )
    return -math.log(2) * (log2_e + math.log2(math.log(2)))


TAKES_FILTERS = False  # engine/sample.py filters on its torch path, then samples there too


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    skip: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    filters: None = None,  # (none here: TAKES_FILTERS)
) -> torch.Tensor:
    """argmax(logits / T + Gumbel noise) per row (argmax(logits) where T == 0) -> [B] int64;
    0 in the rows where `skip` [B] is nonzero, whose logits are not read: a CUDA graph's
    sampling costs nothing in a step that samples again after adjusting the logits.
    `into` = (table, rows): also write each id to table[rows[b], step[b]] (the token table,
    where a sampled id's position is its step), in the same launch that picks it."""
    assert filters is None, "the CUDA sampler takes no filters (TAKES_FILTERS is False)"
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
        FAST=_fast_logs(),
        **launch,
        num_warps=4,
    )
    return _pick_chunk(best_val, best_idx, step, into, triton.cdiv(vocab, block), launch)


def _pick_chunk(
    best_val: torch.Tensor,  # [B, chunks] each chunk's best score
    best_idx: torch.Tensor,  # [B, chunks] and its id
    step: torch.Tensor,
    into: tuple[torch.Tensor, torch.Tensor] | None,
    most_chunks: int,  # of any batch size (the tile is the same for all)
    launch: dict[str, bool],
) -> torch.Tensor:
    """The second kernel of `gumbel_argmax`: each row's best chunk's id (also into the token
    table where `into` is given)."""
    batch, chunks = best_val.shape
    out = torch.empty(batch, dtype=torch.int64, device=best_val.device)
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
        BLOCK_C=triton.next_power_of_2(most_chunks),
        STORE=into is not None,
        **launch,
        num_warps=1,
    )
    return out
