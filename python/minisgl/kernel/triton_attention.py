"""Triton paged attention over the KV pool (`k_flat(layer)`: [num_pages * page_size, kv_heads,
head_dim]; a token's slot is page_table[row, pos // page_size] * page_size + pos % page_size).

- `decode_attention`: one query token per request, split-KV (flash-decoding): each program
  reduces one chunk of one request's KV for all query heads of one kv head (GQA: the KV is read
  once), a second kernel merges the chunks by their log-sum-exp. The split count depends on the
  batch size only and each request sizes its chunks from its own length, so a CUDA graph
  captured at one batch size replays for any KV lengths.
- `extend_attention`: each request's new tokens [cached_len, cached_len + extend_len) attend
  causally to its KV [0, cached_len + extend_len), all read from the pool after the store.

The reference is `minisgl.attention.torch_backend`. Imported only when the triton backend is
chosen, so `import triton` stays off the CPU path."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernel import DecodeRope, flags, pdl
from minisgl.kernel.fused import kv_slots, rope_halves
from minisgl.kernel.pdl import wait_for_previous

LOG2E = tl.constexpr(1.4426950408889634)


def check_head_dim(head_dim: int) -> None:
    # tl.dot needs at least 16 along the reduction axis; tl.arange needs a power of two.
    assert 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0, (
        f"triton attention needs a power-of-two head_dim in [16, 256], got {head_dim}"
    )


def check_operands(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor
) -> tuple[int, int, int, int]:
    """(rows of q, heads, head_dim, kv heads) of an attention call, its layouts checked."""
    rows, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    check_head_dim(dim)
    assert heads % kv_heads == 0 and q.stride(2) == 1 and k_pool.stride(2) == 1
    assert v_pool.stride(2) == 1 and page_table.stride(1) == 1
    return rows, heads, dim, kv_heads


@triton.jit
def _split_chunk(kv_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """KV positions per split of one request: whole blocks, so a short request uses few splits."""
    return tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _rope_row(cos_sin, positions, b, HALF: tl.constexpr):
    """(cos, sin) [1, HALF] of request b's position."""
    row = cos_sin + tl.load(positions + b).to(tl.int64) * (2 * HALF)
    half = tl.arange(0, HALF)
    return tl.load(row + half)[None, :], tl.load(row + HALF + half)[None, :]


@triton.jit
def _rope_q(
    q_rows, h_valid, cos, sin, norm_w, eps, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
    PART: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """This program's query heads in the kernel's two parts of head_dim (rows past the group
    are zeros; one part, the second unused, when PART is the whole head), RoPE'd as the rotary
    kernel would have stored them (after the q-norm when NORM)."""
    half = tl.arange(0, HALF)
    x1 = tl.load(q_rows + half[None, :], mask=h_valid[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(q_rows + HALF + half[None, :], mask=h_valid[:, None], other=0.0).to(tl.float32)
    dtype = q_rows.dtype.element_ty
    y1, y2 = rope_halves(x1, x2, cos, sin, norm_w, half, half < HALF, eps, HALF, NORM, dtype)
    y1, y2 = y1.to(dtype), y2.to(dtype)
    if PART == 2 * HALF:
        y1 = tl.join(y1, y2).permute(0, 2, 1).reshape(BLOCK_H, 2 * HALF)
    return y1, y2


@triton.jit
def _new_kv(
    k_new, v_new, k_dst, v_dst, cos, sin, norm_w, eps, HALF: tl.constexpr, PART: tl.constexpr,
    NORM: tl.constexpr,
):  # fmt: skip
    """One kv head of the new token into its pool slot: k RoPE'd (after the k-norm when NORM),
    v as it is; visible to every thread of the program afterwards. Returns both as the pool
    holds them, in the parts of _attend_blocks' tiles: (k part a, k part b, v a, v b) [1, PART]
    (with one part, b repeats a)."""
    half = tl.arange(0, HALF)
    x1 = tl.load(k_new + half[None, :]).to(tl.float32)
    x2 = tl.load(k_new + HALF + half[None, :]).to(tl.float32)
    dtype = k_new.dtype.element_ty
    y1, y2 = rope_halves(x1, x2, cos, sin, norm_w, half, half < HALF, eps, HALF, NORM, dtype)
    pool = k_dst.dtype.element_ty
    y1, y2 = y1.to(pool), y2.to(pool)
    v1 = tl.load(v_new + half[None, :]).to(pool)
    v2 = tl.load(v_new + HALF + half[None, :]).to(pool)
    tl.store(k_dst + half[None, :], y1)
    tl.store(k_dst + HALF + half[None, :], y2)
    tl.store(v_dst + half[None, :], v1)
    tl.store(v_dst + HALF + half[None, :], v2)
    tl.debug_barrier()
    if PART == 2 * HALF:  # one part: the whole head
        y1 = tl.join(y1, y2).permute(0, 2, 1).reshape(1, 2 * HALF)
        v1 = tl.join(v1, v2).permute(0, 2, 1).reshape(1, 2 * HALF)
        y2, v2 = y1, v1
    return y1, y2, v1, v2


@triton.jit
def _load_parts(rows, offs_a, offs_b, valid, HEAD_DIM: tl.constexpr, PART: tl.constexpr):
    """Parts a and b [BLOCK_N, PART] of a block's K or V rows, in the pool's dtype (with one
    part, b repeats a)."""
    a = tl.load(rows + offs_a[None, :], mask=valid[:, None], other=0.0)
    b = a
    if PART < HEAD_DIM:
        b = tl.load(rows + offs_b[None, :], mask=valid[:, None], other=0.0)
    return a, b


@triton.jit
def _scores(
    qa, qb, k_rows, ka, kb, offs_a, offs_b, valid, qk_scale, LOAD: tl.constexpr,
    PART: tl.constexpr, HEAD_DIM: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """A block's scores [BLOCK_H, BLOCK_N] in log2 units, -inf where not valid, from its K
    parts ka, kb or, when LOAD, from its rows k_rows [BLOCK_N, 1], each part read just before
    its dot (reading both first takes the fp8 tile from 168 to 194 registers, Triton 3.9)."""
    if LOAD:
        ka = tl.load(k_rows + offs_a[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(qa, tl.trans(ka.to(COMPUTE)), input_precision=PRECISION)
    if PART < HEAD_DIM:
        if LOAD:
            kb = tl.load(k_rows + offs_b[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(qb, tl.trans(kb.to(COMPUTE)), s, input_precision=PRECISION)
    s *= qk_scale
    return tl.where(valid[None, :], s, float("-inf"))  # every block has a valid position


@triton.jit
def _softmax(s, m_i):
    """Flash attention's rescaling by one block's scores: (new max, exp2 weights, factor for
    what was accumulated before)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    return m_new, tl.exp2(s - m_new[:, None]), tl.exp2(m_i - m_new)


@triton.jit
def _accumulate(
    p, alpha, v_rows, va, vb, offs_a, offs_b, valid, l_i, acc_a, acc_b, LOAD: tl.constexpr,
    PART: tl.constexpr, HEAD_DIM: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The normaliser and output parts after one block of weights p, from its V parts va, vb
    or, when LOAD, its rows v_rows read part by part (as `_scores` reads K)."""
    pc = p.to(COMPUTE)
    if LOAD:
        va = tl.load(v_rows + offs_a[None, :], mask=valid[:, None], other=0.0)
    acc_a = acc_a * alpha[:, None] + tl.dot(pc, va.to(COMPUTE), input_precision=PRECISION)
    if PART < HEAD_DIM:
        if LOAD:
            vb = tl.load(v_rows + offs_b[None, :], mask=valid[:, None], other=0.0)
        acc_b = acc_b * alpha[:, None] + tl.dot(pc, vb.to(COMPUTE), input_precision=PRECISION)
    return l_i * alpha + tl.sum(p, axis=1), acc_a, acc_b


@triton.jit
def _e4m3_pairs(x, PTX: tl.constexpr):
    """float16 (even, odd) of int16 x, each holding two e4m3 values (low byte: the even
    dim). With PTX one byte permute and two native paired conversions per two elements, in
    x's own register layout: the dot's 16-bit tile comes from ldmatrix, where an 8-bit tile
    widened after the dot operand's shared-memory read costs a byte load and packing a value
    (Triton's `.to`; the interpreter's path)."""
    if PTX:
        even, odd = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; "
            "mov.b32 {lo, hi}, t; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            constraints="=r,=r,r",
            args=[x],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        even = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = ((x >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def _load_pairs(rows, valid, HALF: tl.constexpr, PTX: tl.constexpr):
    """The even and odd dims [BLOCK_N, HALF] float16 of an e4m3 pool's rows [BLOCK_N, 1], read
    as int16 pairs of dims."""
    pairs = rows.to(tl.pointer_type(tl.int16)) + tl.arange(0, HALF)[None, :]
    return _e4m3_pairs(tl.load(pairs, mask=valid[:, None], other=0), PTX)


@triton.jit
def _attend_blocks(
    qa, qb, qk_scale, k_pool, v_pool, kvh, stride_t, stride_h, page_table, row, stride_pt, start,
    end, offs_a, offs_b, m_i, l_i, acc_a, acc_b, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PART: tl.constexpr, COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr, PAIRS: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """(output [BLOCK_H, HEAD_DIM] unnormalised, running max, normaliser) of q attending to
    positions start..end of one kv head (both pools of strides stride_t, stride_h), from the
    running state (m_i, l_i, acc_a, acc_b) of the blocks before. q, K and V are read in two
    parts of head_dim: fewer live registers (fp8 (128, 3): 158 instead of 251 with Triton 3.6
    for sm_90, three programs per SM instead of two). One part below 32 columns (tl.dot needs
    16). With PAIRS (an e4m3 pool) the parts are the even and odd dims (`_load_pairs`)."""
    # The pool slots of a block are read one block ahead: with the page-table load feeding the
    # K/V addresses in the same iteration, Triton's pipeliner spends a stage on it and gives
    # K and V one buffer below 5 stages (session 23); read ahead, n stages give n - 1 buffers
    # (inspect_kernels.py, Triton 3.6 sm_90: fp8 (64, 3) two buffers, 38 KiB, 122 registers).
    pos = start + tl.arange(0, BLOCK_N)
    slot = kv_slots(page_table, row, pos, pos < end, stride_pt, PAGE_SIZE)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        rows_off = slot[:, None] * stride_t + kvh * stride_h
        k_rows = k_pool + rows_off
        slot = kv_slots(page_table, row, pos + BLOCK_N, pos + BLOCK_N < end, stride_pt, PAGE_SIZE)
        ka, kb = qa, qb  # unread unless PAIRS
        if PAIRS:
            ka, kb = _load_pairs(k_rows, valid, PART, PTX)
        s = _scores(qa, qb, k_rows, ka, kb, offs_a, offs_b, valid, qk_scale, not PAIRS, PART,
                    HEAD_DIM, COMPUTE, PRECISION)  # fmt: skip
        m_new, p, alpha = _softmax(s, m_i)
        v_rows = v_pool + rows_off
        va, vb = qa, qb
        if PAIRS:
            va, vb = _load_pairs(v_rows, valid, PART, PTX)
        l_i, acc_a, acc_b = _accumulate(p, alpha, v_rows, va, vb, offs_a, offs_b, valid, l_i,
                                        acc_a, acc_b, not PAIRS, PART, HEAD_DIM, COMPUTE,
                                        PRECISION)  # fmt: skip
        m_i = m_new
    acc = acc_a
    if PAIRS:  # even and odd dims interleave
        acc = tl.join(acc_a, acc_b).reshape(BLOCK_H, HEAD_DIM)
    elif PART < HEAD_DIM:
        acc = tl.join(acc_a, acc_b).permute(0, 2, 1).reshape(BLOCK_H, HEAD_DIM)
    return acc, m_i, l_i


@triton.jit
def _rope_first_block(
    q_rows, h_valid, qk_scale, k_pool, v_pool, stride_t, stride_h, kvh, page_table, row,
    stride_pt, start, end, kv_len, offs_a, offs_b, new_k, new_v, cos_sin, position, out_loc,
    q_norm_w, k_norm_w, eps, owns_new, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PART: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """With RoPE inside: the split's first block is read before the PDL wait (its page-table
    and K/V loads overlap the QKV GEMV that writes q and the new k, v), then q is rotated and,
    in the split that owns the new token, that token stored and patched into the block (a
    later block reads it from the pool). Returns (q parts, running max, normaliser, output
    parts) after the block."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < end
    slot = kv_slots(page_table, row, pos, valid, stride_pt, PAGE_SIZE)[:, None]
    k_rows = k_pool + slot * stride_t + kvh * stride_h
    ka, kb = _load_parts(k_rows, offs_a, offs_b, valid, HEAD_DIM, PART)
    v_rows = v_pool + slot * stride_t + kvh * stride_h
    va, vb = _load_parts(v_rows, offs_a, offs_b, valid, HEAD_DIM, PART)
    cos, sin = _rope_row(cos_sin, position, 0, HALF)
    wait_for_previous(PDL, EARLY=True)
    qa, qb = _rope_q(q_rows, h_valid, cos, sin, q_norm_w, eps, BLOCK_H, HALF, PART, NORM)
    if owns_new:  # the split that reads the new token writes it first
        dst = tl.load(out_loc).to(tl.int64) * stride_t + kvh * stride_h
        nka, nkb, nva, nvb = _new_kv(
            new_k, new_v, k_pool + dst, v_pool + dst, cos, sin, k_norm_w, eps, HALF, PART, NORM
        )
        new = (pos == kv_len - 1)[:, None]
        ka, kb = tl.where(new, nka, ka), tl.where(new, nkb, kb)
        va, vb = tl.where(new, nva, va), tl.where(new, nvb, vb)
    qa, qb = qa.to(COMPUTE), qb.to(COMPUTE)
    s = _scores(qa, qb, k_pool, ka, kb, offs_a, offs_b, valid, qk_scale, False, PART, HEAD_DIM,
                COMPUTE, PRECISION)  # fmt: skip
    m_i, p, alpha = _softmax(s, tl.full([BLOCK_H], float("-inf"), dtype=tl.float32))
    zeros = tl.zeros([BLOCK_H, PART], dtype=tl.float32)
    l_i, acc_a, acc_b = _accumulate(p, alpha, v_pool, va, vb, offs_a, offs_b, valid,
                                    tl.zeros([BLOCK_H], dtype=tl.float32), zeros, zeros, False,
                                    PART, HEAD_DIM, COMPUTE, PRECISION)  # fmt: skip
    return qa, qb, m_i, l_i, acc_a, acc_b


@triton.jit
def _decode_split_kernel(
    q, k_pool, v_pool,  # [B, H, D]; K and V pools [slots, Hkv, D] of the same strides
    page_table, rows, kv_lens,  # [rows, pages] int32; [B] int32 page-table row and KV length
    order,  # [B] int32: the request of each program row, longest first (HAS_ORDER)
    out, part_out, part_lse,  # [B, H, D] contiguous (one split); float32 [B, H, S, D], [B, H, S]
    scale, stride_qb, stride_qh, stride_pool_t, stride_pool_h, stride_pt,
    # ROPE: this step's k and v [B, Hkv, D] (q's and k's before RoPE), of the same strides; the
    # rotary table [max_position, D] float32 (cos | sin); positions, the new token's pool slots
    # [B]; Qwen3's per-head RMSNorm weights and eps (when NORM)
    new_k, new_v, stride_nb, stride_nh, cos_sin, positions, out_loc, q_norm_w, k_norm_w, eps,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head, all handled by one program
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16 for tl.dot
    NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,  # dtype of the dot products' inputs (compute_dtype)
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,  # q, k are unrotated: rotate q here, and k and v into the pool
    NORM: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    PAIRS: tl.constexpr,  # an e4m3 pool read as int16 pairs of dims (`_load_pairs`), no ROPE
    PTX: tl.constexpr,  # ... widened in inline PTX (`_e4m3_pairs`)
    PDL: tl.constexpr,
):  # fmt: skip
    # Before the PDL wait, reads of what no kernel of the step writes (the metadata, copied in
    # before the step): they overlap the kernel before. With ROPE also the first KV block.
    # The kv heads vary fastest over the grid: a request's heads run side by side (they read
    # adjacent bytes of its pages), and with `order` the longest requests start first, so the
    # last programs to start are short ones instead of a long tail.
    kvh, b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_ORDER:
        b = tl.load(order + b)
    kv_len = tl.load(kv_lens + b)
    # each request splits its own length: the launch depends on the batch size only
    chunk = _split_chunk(kv_len, NUM_SPLITS, BLOCK_N)
    start = split * chunk
    if start >= kv_len:  # past this request's end; the merge skips this split
        return
    end = tl.minimum(start + chunk, kv_len)
    row = tl.load(rows + b)
    if not ROPE:
        wait_for_previous(PDL, EARLY=True)
    offs_h = kvh * GROUP + tl.arange(0, BLOCK_H)
    h_valid = tl.arange(0, BLOCK_H) < GROUP
    HALF: tl.constexpr = HEAD_DIM // 2
    PART: tl.constexpr = HALF if HALF >= 16 else HEAD_DIM  # _attend_blocks' parts of a head
    offs_a = tl.arange(0, PART)
    offs_b = HEAD_DIM - PART + offs_a  # offs_a (and unused) with one part
    if PAIRS:  # the parts are the even and odd dims
        offs_a = 2 * tl.arange(0, PART)
        offs_b = offs_a + 1
    q_rows = q + b * stride_qb + offs_h[:, None] * stride_qh
    qk_scale = scale * LOG2E  # scores in log2 units (exp2 inside)
    if ROPE:
        qa, qb, m_i, l_i, acc_a, acc_b = _rope_first_block(
            q_rows, h_valid, qk_scale, k_pool, v_pool, stride_pool_t, stride_pool_h, kvh,
            page_table, row, stride_pt, start, end, kv_len, offs_a, offs_b,
            new_k + b * stride_nb + kvh * stride_nh, new_v + b * stride_nb + kvh * stride_nh,
            cos_sin, positions + b, out_loc + b, q_norm_w, k_norm_w, eps,
            start + chunk >= kv_len, BLOCK_H, BLOCK_N, PAGE_SIZE, HEAD_DIM, PART, COMPUTE,
            PRECISION, NORM, PDL,
        )  # fmt: skip
        start += BLOCK_N
    else:
        qa = tl.load(q_rows + offs_a[None, :], mask=h_valid[:, None], other=0.0).to(COMPUTE)
        qb = tl.load(q_rows + offs_b[None, :], mask=h_valid[:, None], other=0.0).to(COMPUTE)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_a = tl.zeros([BLOCK_H, PART], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_H, PART], dtype=tl.float32)
    acc, m_i, l_i = _attend_blocks(
        qa, qb, qk_scale, k_pool, v_pool, kvh, stride_pool_t, stride_pool_h, page_table, row,
        stride_pt, start, end, offs_a, offs_b, m_i, l_i, acc_a, acc_b, BLOCK_H, BLOCK_N,
        PAGE_SIZE, HEAD_DIM, PART, COMPUTE, PRECISION, PAIRS, PTX,
    )  # fmt: skip
    _store_split(acc, m_i, l_i, out, part_out, part_lse, b, split, offs_h, h_valid, NUM_HEADS,
                 NUM_SPLITS, HEAD_DIM)  # fmt: skip


@triton.jit
def _store_split(
    acc, m_i, l_i, out, part_out, part_lse, b, split, offs_h, h_valid, NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """A split's normalised output: into `out` when it is the only split, else with its
    log-sum-exp into the partials the merge reads."""
    offs_d = tl.arange(0, HEAD_DIM)
    res = acc / l_i[:, None]
    if NUM_SPLITS == 1:  # nothing to merge
        dst = out + (b * NUM_HEADS + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(dst, res.to(out.dtype.element_ty), mask=h_valid[:, None])
    else:
        base = (b * NUM_HEADS + offs_h) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out + base[:, None] * HEAD_DIM + offs_d[None, :], res, mask=h_valid[:, None])
        tl.store(part_lse + base, m_i + tl.log2(l_i), mask=h_valid)


@triton.jit
def _decode_merge_kernel(
    part_out,  # [B, H, S, D] float32
    part_lse,  # [B, H, S] float32
    kv_lens,  # [B] int32
    out,  # [B, H, D]
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    LOW: tl.constexpr,  # splits in the first tile: min(16, NUM_SPLITS rounded up to a power of 2)
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """The splits past LOW are read only when a request used them: a short request's merge
    loads one LOW-row tile. At batch 1 on an H100 (1,000 positions in 32 splits, 16 of which
    ran) the kernel pair took 7.3 us against 8.3 with one 32-row tile, and one stream decoded
    2.2 % faster (session 23, docs/benchmarks.md)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(kv_lens + b)  # before the wait: no kernel of the step writes it
    used = tl.cdiv(kv_len, _split_chunk(kv_len, NUM_SPLITS, BLOCK_N))  # splits that ran
    wait_for_previous(PDL, EARLY=True)
    base = (b * tl.num_programs(1) + h) * NUM_SPLITS
    m, acc, total = _merge_tile(part_out, part_lse, base, 0, used, LOW, HEAD_DIM)
    if NUM_SPLITS > LOW:
        if used > LOW:  # NUM_SPLITS <= 32, so one more tile holds the rest
            m_hi, acc_hi, total_hi = _merge_tile(part_out, part_lse, base, LOW, used, LOW, HEAD_DIM)
            top = tl.maximum(m, m_hi)
            acc = acc * tl.exp2(m - top) + acc_hi * tl.exp2(m_hi - top)
            total = total * tl.exp2(m - top) + total_hi * tl.exp2(m_hi - top)
    res = acc / total
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(out + b * stride_ob + h * stride_oh + offs_d, res.to(out.dtype.element_ty))


@triton.jit
def _merge_tile(part_out, part_lse, base, first, used, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(max log-sum-exp, weighted sum of outputs, sum of weights) of splits first..first+ROWS
    that ran; the weights are relative to that maximum. Split `first` always ran."""
    offs_s = first + tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    ran = offs_s < used
    lse = tl.load(part_lse + base + offs_s, mask=ran, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - m)
    o = tl.load(
        part_out + (base + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
        mask=ran[:, None],
        other=0.0,
    )
    return m, tl.sum(w[:, None] * o, axis=0), tl.sum(w, axis=0)


def compute_dtype(q: torch.Tensor, k_pool: torch.Tensor) -> tl.dtype:
    """The dot products' input dtype: q's, except float16 for a 16-bit q over an fp8 pool:
    fp8 -> fp16 is one native conversion per two values on sm89+ (fp8 -> bf16 takes several),
    and fp16 holds every e4m3 / e5m2 value exactly (q and the probabilities get rounded to
    fp16, finer than bf16 in their range)."""
    if q.dtype == torch.float32:
        return tl.float32
    return tl.float16 if k_pool.dtype.itemsize == 1 or q.dtype == torch.float16 else tl.bfloat16


def e4m3_pairs(q: torch.Tensor, k_pool: torch.Tensor, rope: bool) -> bool:
    """Whether the decode kernel reads an e4m3 pool as int16 pairs of dims (`_load_pairs`):
    for a 16-bit q (float16 compute), head_dim halves of >= 16 and no RoPE inside (whose first
    block is read in halves)."""
    halves = k_pool.shape[-1] % 2 == 0 and k_pool.shape[-1] // 2 >= 16
    return k_pool.dtype == torch.float8_e4m3fn and q.dtype != torch.float32 and halves and not rope


class DecodeTuning(NamedTuple):
    block_n: int  # KV positions per block
    # Triton 3.6 gives the K/V loads, which follow a page-table load, one shared-memory buffer
    # below 5 stages (the next block's copy waits for this block's compute); 5 gives two.
    num_stages: int
    maxnreg: int | None = None  # registers per thread, capped for occupancy (None: no cap)


def decode_tuning(k_pool: torch.Tensor, num_splits: int, rope: bool = False) -> DecodeTuning:
    """The decode kernel's tiles, H100 (`benchmark/kernels/decode_attention_bench.py`, CUDA
    graph replays). 256 requests x 300-1800 tokens, one split: an fp8 pool takes 223 us at
    (128, 3) against 236 at (128, 5) and 228 at (64, 5) (session 24: the head_dim halves give
    (128, 3) 158 registers, three programs per SM; with whole rows (128, 5) was best at 229
    us, its two K/V buffers hiding what two programs per SM could not). bf16 takes 379-382 us
    at (128, 2) against 385-387 at (64, 2) (+1.4 % end to end); 5 stages change nothing there.
    With splits (small batches) the chunks are short and 64 keeps them apart: one stream
    decodes 1-3 % faster at (64, 2). 5 stages help there only with 1-2 programs per SM (one
    request of 32,000 positions: 54.9 against 57.3 us) and cost with more (4 requests of
    8,000: 58.9 against 53.3 us; 16 of 300-1,800: 40.2 against 37.5). With RoPE inside (one
    request) the first block is held in registers across the PDL wait: an fp8 block of 128
    spills there (Triton 3.6: 255 registers, 191 spill instructions), one of 64 does not (193).
    Session 29, with the slots read one block ahead (`_attend_blocks`): fp8 (64, 3) takes 209
    us against 223 at (128, 3) before (230 at (128, 3) after), bf16 (64, 3) 367 against 371;
    end to end, A B A B: fp8 +2.2 %, bf16 +0.7 %. Session 30, an e4m3 pool read as int16
    pairs (`_load_pairs`, 96 registers): (64, 3) 200.5 us, (32, 3) with 2 warps 193.5 (2.85
    TB/s) but 1-2 % slower end to end, so (64, 3) with 4 warps stays."""
    if k_pool.dtype.itemsize == 1 and rope:
        return DecodeTuning(64, 3)
    if k_pool.dtype.itemsize == 1:
        return DecodeTuning(64, 3)
    return DecodeTuning(64, 3) if num_splits == 1 else DecodeTuning(64, 2)


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once per device."""
    return torch.cuda.get_device_capability(device_index)


def native_fp8(device_index: int | None) -> bool:
    """Whether the CUDA device converts e4m3 pairs natively (sm_89+)."""
    return _capability(device_index) >= (8, 9)


def hopper(device_index: int | None) -> bool:
    """Whether the CUDA device is a Hopper GPU (sm_90)."""
    return _capability(device_index)[0] == 9


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter (tests): a few splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(batch_size: int, num_kv_heads: int, sm_count: int, per_sm: int = 4) -> int:
    """KV splits per request of a decode batch: about `per_sm` (request, kv head, split)
    programs per SM (4; other targets for benchmarks), at most 32. It never depends on KV
    lengths, so one CUDA graph per batch size serves any lengths: each request cuts its own KV
    into this many block-aligned chunks, and the chunks past a short request's end exit at
    once."""
    return max(1, min(32, triton.cdiv(per_sm * sm_count, batch_size * num_kv_heads)))


def _rope_args(rope: DecodeRope | None, q: torch.Tensor) -> tuple:
    """The decode kernel's RoPE arguments (placeholders without RoPE: never read)."""
    if rope is None:
        return (q, q, 0, 0, q, q, q, q, q, 0.0)
    k, v = rope.k, rope.v
    assert k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2]
    assert k.stride() == v.stride() and k.stride(2) == 1 and rope.cos_sin.is_contiguous()
    assert rope.cos_sin.dtype == torch.float32 and rope.cos_sin.shape[1] == q.shape[2]
    q_w, k_w, eps = rope.qk_norm or (q, q, 0.0)
    return (
        k, v, k.stride(0), k.stride(1), rope.cos_sin, rope.positions, rope.out_loc, q_w, k_w, eps,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_pool: torch.Tensor,  # [slots, Hkv, D]
    v_pool: torch.Tensor,
    page_table: torch.Tensor,  # [rows, pages] int32
    rows: torch.Tensor,  # [B] int32
    kv_lens: torch.Tensor,  # [B] int32, each >= 1
    num_splits: int,
    page_size: int,
    scale: float,
    tuning: DecodeTuning | None = None,  # default: decode_tuning(k_pool, num_splits)
    num_warps: int = 4,
    rope: DecodeRope | None = None,  # q (and rope.k) before RoPE: rotated and stored here
    order: torch.Tensor | None = None,  # [B] int32 permutation: requests longest first
) -> torch.Tensor:
    """Graph-safe: the launches and allocations depend only on the shapes and num_splits.
    `tuning` and `num_warps` are knobs for benchmarks."""
    bsz, heads, dim, kv_heads = check_operands(q, k_pool, v_pool, page_table)
    assert v_pool.stride() == k_pool.stride(), "one pair of pool strides for K and V"
    assert 1 <= num_splits <= 32, "the merge reads at most two 16-split tiles"
    block_n, num_stages, maxnreg = tuning or decode_tuning(k_pool, num_splits, rope is not None)
    out = torch.empty(bsz, heads, dim, dtype=q.dtype, device=q.device)
    part_out, part_lse = _split_buffers(out, num_splits)
    launch = pdl.options(q.device)
    _decode_split_kernel[(kv_heads, bsz, num_splits)](
        q,
        k_pool,
        v_pool,
        page_table,
        rows,
        kv_lens,
        kv_lens if order is None else order,  # unread without HAS_ORDER
        out,
        part_out,
        part_lse,
        scale,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        page_table.stride(0),
        *_rope_args(rope, q),
        NUM_HEADS=heads,
        GROUP=heads // kv_heads,
        BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        NUM_SPLITS=num_splits,
        PAGE_SIZE=page_size,
        HEAD_DIM=dim,
        BLOCK_N=block_n,
        **_decode_variant(q, k_pool, rope, order),
        **launch,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits(part_out, part_lse, kv_lens, out, block_n, launch)
    return out


def _split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' float32 outputs [B, H, S, D] and log-sum-exps [B, H, S] (with one split,
    placeholders never written: the kernel writes `out` itself)."""
    if num_splits == 1:
        return out, out
    bsz, heads, dim = out.shape
    part_out = torch.empty(bsz, heads, num_splits, dim, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_lse


def _decode_variant(
    q: torch.Tensor, k_pool: torch.Tensor, rope: DecodeRope | None, order: torch.Tensor | None
) -> dict[str, Any]:
    """The split kernel's compile-time switches that follow from its operands."""
    return dict(
        COMPUTE=compute_dtype(q, k_pool),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ROPE=rope is not None,
        NORM=rope is not None and rope.qk_norm is not None,
        HAS_ORDER=order is not None,
        PAIRS=e4m3_pairs(q, k_pool, rope is not None),
        PTX=q.is_cuda and not flags.triton_interpret() and native_fp8(q.device.index),
    )


def _merge_splits(
    part_out: torch.Tensor,  # [B, H, S, D] float32
    part_lse: torch.Tensor,  # [B, H, S] float32
    kv_lens: torch.Tensor,
    out: torch.Tensor,  # [B, H, D]
    block_n: int,  # the split kernel's, whose chunks the merge recomputes
    launch: dict[str, bool],
) -> None:
    bsz, heads, num_splits, dim = part_out.shape
    _decode_merge_kernel[(bsz, heads)](
        part_out,
        part_lse,
        kv_lens,
        out,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        LOW=min(16, triton.next_power_of_2(num_splits)),
        HEAD_DIM=dim,
        BLOCK_N=block_n,
        **launch,
        num_warps=1 if dim <= 64 else 2,
    )


@triton.jit
def _extend_block(
    qb, qk_scale, q_pos, n0, kv_end, slot, k_pool, v_pool, kvh, stride_kt, stride_kh, stride_vt,
    stride_vh, page_table, row, stride_pt, offs_d, m_i, l_i, acc, CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One KV block of `_extend_kernel` at positions n0.., whose pool slots `slot` were read
    the block before: the running state after it, and the next block's slots. Without CAUSAL
    the block lies wholly before every query row's position: no mask on the scores nor the
    loads (sm_90: about 100 fewer instructions of ~710 a block)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    n_valid = pos < kv_end
    if not CAUSAL:
        n_valid = tl.full([BLOCK_N], 1, tl.int1)
    next_slot = kv_slots(
        page_table, row, pos + BLOCK_N, pos + BLOCK_N < kv_end, stride_pt, PAGE_SIZE
    )
    kb = tl.load(
        k_pool + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
        mask=n_valid[:, None],
        other=0.0,
    ).to(COMPUTE)
    s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION) * qk_scale
    if CAUSAL:
        allowed = (pos[None, :] <= q_pos[:, None]) & n_valid[None, :]
        # every query row sees position 0 in the first block, so the max is finite from there on
        s = tl.where(allowed, s, float("-inf"))
    m_new, p, alpha = _softmax(s, m_i)
    v_rows = v_pool + slot[:, None] * stride_vt + kvh * stride_vh
    l_i, acc, _ = _accumulate(p, alpha, v_rows, qb, qb, offs_d, offs_d, n_valid, l_i, acc, acc,
                              True, HEAD_DIM, HEAD_DIM, COMPUTE, PRECISION)  # fmt: skip
    return m_new, l_i, acc, next_slot


@triton.jit
def _extend_kernel(
    q, k_pool, v_pool, out,  # q, out [T, H, D]: tokens of all requests, back to back; pools
    page_table, rows, q_starts, cached_lens, extend_lens,  # rows .. extend_lens: [B] int32
    scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_oh, stride_pt,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" keeps float32 exact; tf32 otherwise unused for 16-bit
):  # fmt: skip
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    extend = tl.load(extend_lens + b)
    if mb * BLOCK_M >= extend:
        return
    kvh = h // GROUP
    row = tl.load(rows + b)
    cached = tl.load(cached_lens + b)
    q_start = tl.load(q_starts + b)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < extend
    q_pos = cached + offs_m
    qb = tl.load(
        q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_valid[:, None],
        other=0.0,
    ).to(COMPUTE)
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # the block's last valid query sees up to this position (causal); every query row sees
    # the whole blocks before `full_end`, which skip the causal mask (most of a long prompt's)
    kv_end = cached + tl.minimum((mb + 1) * BLOCK_M, extend)
    full_end = (cached + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    # slots read one block ahead, as `_attend_blocks` does: (64, 64, 4, 3) gets three K/V
    # buffers instead of two (Triton 3.6 sm_90: 193 registers, 112 KiB)
    pos = tl.arange(0, BLOCK_N)
    slot = kv_slots(page_table, row, pos, pos < kv_end, stride_pt, PAGE_SIZE)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc, slot = _extend_block(
            qb, qk_scale, q_pos, n0, kv_end, slot, k_pool, v_pool, kvh, stride_kt, stride_kh,
            stride_vt, stride_vh, page_table, row, stride_pt, offs_d, m_i, l_i, acc, False,
            BLOCK_N, PAGE_SIZE, HEAD_DIM, COMPUTE, PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc, slot = _extend_block(
            qb, qk_scale, q_pos, n0, kv_end, slot, k_pool, v_pool, kvh, stride_kt, stride_kh,
            stride_vt, stride_vh, page_table, row, stride_pt, offs_d, m_i, l_i, acc, True,
            BLOCK_N, PAGE_SIZE, HEAD_DIM, COMPUTE, PRECISION,
        )  # fmt: skip

    res = acc / l_i[:, None]
    tl.store(
        out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        res.to(out.dtype.element_ty),
        mask=m_valid[:, None],
    )


def extend_attention(
    q: torch.Tensor,  # [T, H, D]
    k_pool: torch.Tensor,  # [slots, Hkv, D]
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,  # [B] int32
    q_starts: torch.Tensor,  # [B] int32
    cached_lens: torch.Tensor,  # [B] int32
    extend_lens: torch.Tensor,  # [B] int32
    max_extend_len: int,
    page_size: int,
    scale: float,
    tuning: tuple[int, int, int, int] | None = None,  # default: extend_tuning(q)
) -> torch.Tensor:
    """`tuning` (block_m, block_n, num_warps, num_stages) is a knob for benchmarks."""
    tokens, heads, dim, kv_heads = check_operands(q, k_pool, v_pool, page_table)
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    fp32 = q.dtype == torch.float32
    block_m, block_n, num_warps, num_stages = tuning or extend_tuning(q)
    grid = (triton.cdiv(max_extend_len, block_m), rows.shape[0], heads)
    _extend_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        page_table,
        rows,
        q_starts,
        cached_lens,
        extend_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=heads // kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        COMPUTE=compute_dtype(q, k_pool),
        PRECISION="ieee" if fp32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def extend_tuning(q: torch.Tensor) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the extend kernel. On an H100, head_dim
    128, bf16 (`benchmark/kernels/extend_attention_bench.py`): (64, 64, 4, 3) took 99.8 us
    for 16 prompts of 512 tokens, 92.5 for one of 2,000 and 439 for 4 x 1,024 after 3,072
    cached, against 187, 188 and 1,106 at (32, 32, 4, 2), which other GPUs keep (its three
    stages of 64 x 128 K and V tiles need Hopper's shared memory; not measured elsewhere, nor
    for head_dim 256, whose tiles would be twice as large). Session 29, with the slots read
    one block ahead: 16 x 512 95.7 us against 99.4 before, 2 x 1,024 after 3,072 cached 217.8
    against 231.9, 14 x 585 after 128 decode rows 325 against 353; 2 or 4 stages lose.
    Session 30, whole blocks without the causal mask (`_extend_block`): 184.5 against 218.6,
    319.0 against 325.6, 97.8 against 97.0 (16 x 512: mostly diagonal blocks)."""
    dim, fp32 = q.shape[-1], q.dtype == torch.float32
    if dim == 128 and not fp32 and q.is_cuda and hopper(q.device.index):
        return 64, 64, 4, 3
    small = dim <= 64
    return (64 if small and not fp32 else 32), (64 if small else 32), 4, 2
