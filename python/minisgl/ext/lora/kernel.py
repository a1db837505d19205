"""The LoRA delta of a batch whose tokens use different adapters, in two Triton launches (the
torch reference: `layers.lora_reference`, same math, float32 accumulation):

- shrink: inter[t] = x[t] A_s^T for each token t of slot s (inter: [T, parts * rank], float32,
  as partial sums over a few ranges of K when there are few token tiles: a decode step);
- expand: y[t, cols of part j] += inter[t, rank block j] B_s[cols]^T, in place.

One kernel serves prefill segments (SGMV) and decode rows (BGMV): program (s, m, n) covers
slot s, a tile of BLOCK_M consecutive tokens and a tile of outputs. It reads the tile's slot
indices and ends at once when none is s; otherwise it computes the tile with the other slots'
rows masked out. A prefill's tokens come in runs of one request (one slot), so most tiles hold
one slot; a decode tile holds at most BLOCK_M rows, and each slot among them reads its weights
once. Every (token, output) is written by the one program of the token's slot: no races, no
sort, no host sync, shapes fixed by (T, slots): the launches can be captured in CUDA graphs
with the slot indices as graph input. Slot 0 (no adapter) launches nothing.

A decode step that takes the GEMV (`kernel/gemv.py`: a few rows) needs no shrink: the GEMV
reads the weight together with every slot's A (`weights._joint`), so its output row holds each
slot's x A^T beside the base output, and `lora_expand_joint` reads the token's slot from there
and writes base + delta (or, for gate_up, SiLU(gate) * up) into a new tensor: one launch
after the GEMV, where the general path takes the shrink, the expand and the activation's own.

Imported only for CUDA tensors (`kernel.fused_ops`) and by the interpreter tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernel import pdl
from minisgl.kernel.pdl import wait_for_previous


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    """a @ b with float32 accumulation: IEEE float32 for float32 models (no TF32), else in
    the 16-bit dtype of b."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _shrink_kernel(
    x,  # [T, K]
    slots,  # [T] int
    a,  # [S + 1, R, K]
    inter,  # [SPLIT, T, R] float32: partial sums over SPLIT ranges of K
    T,
    K,
    R,
    K_SPLIT,  # the K range of one split, a multiple of BLOCK_K
    stride_xt,
    stride_as,
    stride_ar,
    stride_is,
    stride_it,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
):
    s = tl.program_id(0) + 1
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    hit = tl.load(slots + rows, mask=rows < T, other=0) == s
    if tl.max(hit.to(tl.int32), axis=0) == 0:
        return
    split = tl.program_id(2) % SPLIT
    cols = (tl.program_id(2) // SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_row = a + s.to(tl.int64) * stride_as + cols[None, :].to(tl.int64) * stride_ar
    x_row = x + rows[:, None].to(tl.int64) * stride_xt
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wait_for_previous(PDL)  # x: the kernel before wrote it (slots come from the step's start)
    for k0 in range(split * K_SPLIT, tl.minimum(K, (split + 1) * K_SPLIT), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_row + ks[None, :], mask=hit[:, None] & (ks[None, :] < K), other=0.0)
        at = tl.load(a_row + ks[:, None], mask=(cols[None, :] < R) & (ks[:, None] < K), other=0.0)
        acc += _dot(xt, at, EXACT)
    out = inter + split * stride_is + rows[:, None].to(tl.int64) * stride_it + cols[None, :]
    tl.store(out, acc, mask=hit[:, None] & (cols[None, :] < R))


@triton.jit
def _expand_kernel(
    inter,  # [SPLIT, T, parts * RANK] float32: partial sums to add
    slots,  # [T] int
    b,  # [S + 1, N, RANK]
    y,  # [T, N], updated in place
    offsets,  # [parts + 1] int32: where each part's output rows start, then N
    T,
    RANK,
    stride_is,
    stride_it,
    stride_bs,
    stride_bn,
    stride_yt,
    SPLIT: tl.constexpr,
    TILES: tl.constexpr,  # output tiles per part (of the largest part)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
):
    s = tl.program_id(0) + 1
    part = tl.program_id(2) // TILES
    start = tl.load(offsets + part) + (tl.program_id(2) % TILES) * BLOCK_N
    end = tl.load(offsets + part + 1)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    hit = tl.load(slots + rows, mask=rows < T, other=0) == s
    if (start >= end) | (tl.max(hit.to(tl.int32), axis=0) == 0):
        return
    cols = start + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    row_ok, col_ok, rank_ok = hit[:, None], cols[None, :] < end, ranks < RANK
    b_ptr = b + s.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn
    bt = tl.load(b_ptr + ranks[:, None], mask=col_ok & rank_ok[:, None], other=0.0)
    wait_for_previous(PDL)  # B is no kernel's output; inter and y are
    it_ptr = inter + rows[:, None].to(tl.int64) * stride_it + part * RANK + ranks[None, :]
    it = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(SPLIT):
        it += tl.load(it_ptr + split * stride_is, mask=row_ok & rank_ok[None, :], other=0.0)
    acc = _dot(it, bt, EXACT)
    y_ptr = y + rows[:, None].to(tl.int64) * stride_yt + cols[None, :]
    base = tl.load(y_ptr, mask=row_ok & col_ok, other=0.0)
    tl.store(y_ptr, (base.to(tl.float32) + acc).to(base.dtype), mask=row_ok & col_ok)


@triton.jit
def _joint_value(out_row, b_row, cols, ok, inter_col, lead, rank, stride_bn,
                 BLOCK_R: tl.constexpr):  # fmt: skip
    """One token's base + LoRA delta at `cols` (float32): the GEMV wrote the base output at
    lead + col and this part's x A^T of the token's slot at inter_col (`rank` 0: slot 0)."""
    base = tl.load(out_row + lead + cols, mask=ok, other=0.0).to(tl.float32)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    inter = tl.load(out_row + inter_col + ranks, mask=rank_ok, other=0.0).to(tl.float32)
    b_ptr = b_row + cols[:, None].to(tl.int64) * stride_bn + ranks[None, :]
    bt = tl.load(b_ptr, mask=ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
    return base + tl.sum(bt * inter[None, :], axis=1)


@triton.jit
def _joint_expand_kernel(
    out,  # [T, lead + N]: the GEMV of x with [A of every slot; W]
    slots,  # [T] int
    b,  # [S + 1, N, RANK]
    y,  # [T, N], or [T, N / 2] with SILU
    offsets,  # [parts + 1] int32: where each part's output rows start, then N
    lead,  # the A rows before W: (S + 1) * parts * RANK
    RANK,
    stride_ot,
    stride_bs,
    stride_bn,
    stride_yt,
    TILES: tl.constexpr,  # output tiles per part (of the largest part)
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SILU: tl.constexpr,  # gate_up: y = SiLU(gate) * up, parts 0 and 1 of equal size
    PDL: tl.constexpr,
):
    t = tl.program_id(0)
    wait_for_previous(PDL)  # out: the GEMV before wrote it
    s = tl.load(slots + t)
    out_row = out + t.to(tl.int64) * stride_ot
    b_row = b + s.to(tl.int64) * stride_bs
    rank = tl.where(s != 0, RANK, 0)  # slot 0 reads no A^T x nor B
    tile = tl.program_id(1)
    if SILU:
        half = tl.load(offsets + 1)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < half
        inter_col = s * 2 * RANK
        gate = _joint_value(out_row, b_row, cols, ok, inter_col, lead, rank, stride_bn, BLOCK_R)
        up = _joint_value(out_row, b_row, half + cols, ok, inter_col + RANK, lead, rank,
                          stride_bn, BLOCK_R)  # fmt: skip
        value = gate * tl.sigmoid(gate) * up
    else:
        part = tile // TILES
        start = tl.load(offsets + part) + (tile % TILES) * BLOCK_N
        end = tl.load(offsets + part + 1)
        if start >= end:
            return
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < end
        parts = tl.num_programs(1) // TILES
        inter_col = (s * parts + part) * RANK
        value = _joint_value(out_row, b_row, cols, ok, inter_col, lead, rank, stride_bn, BLOCK_R)
    tl.store(y + t.to(tl.int64) * stride_yt + cols, value.to(y.dtype.element_ty), mask=ok)


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 16 else 32 if tokens <= 256 else 64


@dataclass(frozen=True)
class Tiles:
    """The launches' tiles (benchmark/kernels/lora_bench.py sweeps them on a GPU)."""

    block_k: int = 128  # the shrink's K step
    max_split: int = 32  # K ranges of a decode step's shrink; the expand adds them all
    shrink_warps: int = 4
    expand_block_n: int = 64
    wide_block_n: int = 256  # the expand's tile at 1-2 rows where a part has WIDE outputs (gate/up)
    expand_warps: int = 4
    joint_block_n: int = 64  # outputs a program of `lora_expand_joint`


TILES = Tiles()
WIDE = 8192
_SPLIT_TOKENS = 256  # batches up to this size split K (decode steps); larger ones do not


def _split_k(k: int, tokens: int, tiles: Tiles) -> tuple[int, int]:
    """(splits, K per split) of the shrink. A decode step has one or a few token tiles, so
    without splitting K a handful of programs would each loop over all of K (latency-bound);
    a prefill has tiles enough. Two choices only, not one per batch size: SPLIT is a
    compile-time constant, and every new value compiled Triton variants in the middle of
    serving (on the H200 about 4 s of a 21 s run, measured with `bench.py --profile`)."""
    step = tiles.block_k
    split = min(triton.cdiv(k, 2 * step), tiles.max_split) if tokens <= _SPLIT_TOKENS else 1
    per = triton.cdiv(triton.cdiv(k, split), step) * step
    return triton.cdiv(k, per), per


def lora_shrink(
    x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, tiles: Tiles = TILES
) -> torch.Tensor | None:
    """The first launch: x [T, K] A_s^T for each token's slot s (slots [T], 0: none; a
    [S + 1, parts * rank, K]) -> [SPLIT, T, parts * rank] float32 partial sums; None when
    there is nothing to add (no token, or no adapter slot)."""
    tokens, k = x.shape
    slots_n, r_total = a.shape[0] - 1, a.shape[1]
    if tokens == 0 or slots_n == 0:
        return None
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert a.is_contiguous()
    bm = _block_m(tokens)
    bn = min(64, max(16, triton.next_power_of_2(r_total)))
    split, per = _split_k(k, tokens, tiles)
    inter = torch.empty((split, tokens, r_total), dtype=torch.float32, device=x.device)
    grid = (slots_n, triton.cdiv(tokens, bm), triton.cdiv(r_total, bn) * split)
    _shrink_kernel[grid](
        x, slots, a, inter, tokens, k, r_total, per,
        x.stride(0), a.stride(0), a.stride(1), inter.stride(0), inter.stride(1),
        SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=tiles.block_k,
        EXACT=x.dtype == torch.float32, num_warps=tiles.shrink_warps, **pdl.options(x.device),
    )  # fmt: skip
    return inter


def lora_expand(
    y: torch.Tensor,
    inter: torch.Tensor,
    slots: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    bounds: list[int],
    tiles: Tiles = TILES,
) -> torch.Tensor:
    """The second launch: y [T, N] += the shrink's `inter` B_s^T, in place -> y. b [S + 1, N,
    rank]; offsets = bounds (the parts' first output rows, then N) on the device."""
    tokens, slots_n, rank = y.shape[0], b.shape[0] - 1, b.shape[2]
    assert y.stride(-1) == 1 and b.is_contiguous()
    bm = _block_m(tokens)
    widest = max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    # (a wide tile pays on one or two rows: 0.8 us less on gate/up; on 8 rows, 0.9 us more)
    wide = widest >= WIDE and tokens <= 2
    bn = tiles.wide_block_n if wide else tiles.expand_block_n
    n_tiles = triton.cdiv(widest, bn)
    _expand_kernel[(slots_n, triton.cdiv(tokens, bm), (len(bounds) - 1) * n_tiles)](
        inter, slots, b, y, offsets, tokens, rank,
        inter.stride(0), inter.stride(1), b.stride(0), b.stride(1), y.stride(0),
        SPLIT=inter.shape[0], TILES=n_tiles, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), EXACT=y.dtype == torch.float32,
        num_warps=tiles.expand_warps, **pdl.options(y.device),
    )  # fmt: skip
    return y


def lora_expand_joint(
    out: torch.Tensor,
    slots: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    bounds: list[int],
    silu: bool = False,
    tiles: Tiles = TILES,
) -> torch.Tensor:
    """The decode launch after the GEMV of x with [A of every slot; W] (`out` [T, lead + N]):
    y [T, N] = base + each token's LoRA delta; with `silu` (gate_up: two parts of N / 2)
    SiLU(gate) * up [T, N / 2]. b [S + 1, N, rank]; offsets = bounds on the device."""
    tokens, rank, n = out.shape[0], b.shape[2], bounds[-1]
    parts = len(bounds) - 1
    lead = out.shape[1] - n
    assert out.stride(-1) == 1 and b.is_contiguous() and lead == b.shape[0] * parts * rank
    widest = max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    if silu and (parts != 2 or 2 * bounds[1] != n):
        raise ValueError(f"lora_expand_joint: silu needs two equal parts, got bounds {bounds}")
    y = torch.empty(tokens, n // 2 if silu else n, dtype=out.dtype, device=out.device)
    if tokens == 0:
        return y
    bn = tiles.joint_block_n
    n_tiles = triton.cdiv(widest, bn)
    _joint_expand_kernel[(tokens, n_tiles if silu else parts * n_tiles)](
        out, slots, b, y, offsets, lead, rank,
        out.stride(0), b.stride(0), b.stride(1), y.stride(0),
        TILES=n_tiles, BLOCK_N=bn, BLOCK_R=max(16, triton.next_power_of_2(rank)), SILU=silu,
        num_warps=tiles.expand_warps, **pdl.options(out.device),
    )  # fmt: skip
    return y


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    bounds: list[int],
    tiles: Tiles = TILES,
) -> torch.Tensor:
    """y [T, N] += each token's LoRA delta, in place -> y: the two launches back to back."""
    inter = lora_shrink(x, slots, a, tiles)
    return y if inter is None else lora_expand(y, inter, slots, b, offsets, bounds, tiles)
