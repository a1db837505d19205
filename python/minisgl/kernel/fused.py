"""Triton kernels for the memory-bound ops between the GEMMs: RMSNorm (+ residual add), rotary
embedding (optionally with Qwen3's q/k norm and the KV-cache store in the same pass: the one
kernel between the QKV GEMM and attention), SiLU-and-mul, the KV-cache store, and a decode
step's input ids and KV slots gathered from the token and page tables. Math in float32, results
cast to the output's dtype. Launches depend only on shapes (no host sync, no
data-dependent allocation), so they can be captured in CUDA graphs.

The torch references, which are also the CPU path, live next to their callers:
`layers/norm.py`, `layers/rotary.py`, `layers/activation.py`, `kvcache/pool.py`,
`engine/step.py`; the layers reach
this module through `minisgl.kernel.fused_ops`. Imported only on CUDA, so `import triton` stays
off the CPU path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel import pdl
from minisgl.kernel.pdl import wait_for_previous


def _num_warps(elements: int) -> int:
    return max(1, min(8, elements // 256))  # about 8 elements (16 bytes of bf16) per thread


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, N] or [T, H, N] as a [T, H, N] view (hidden states have H = 1)."""
    assert x.dim() in (2, 3) and x.stride(-1) == 1, (
        f"rms_norm needs [T, N] or [T, H, N] with unit last stride, got {tuple(x.shape)} "
        f"strides {x.stride()}"
    )
    return x.unsqueeze(1) if x.dim() == 2 else x


@triton.jit
def _rms_norm_kernel(
    x,
    residual,  # read and overwritten with x + residual when HAS_RESIDUAL
    out,
    weight,
    eps,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    stride_ot,
    stride_oh,
    HEADS: tl.constexpr,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)  # one program per row x[t, h]
    t = (row // HEADS).to(tl.int64)
    h = row % HEADS
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_for_previous(PDL, EARLY=True)
    x32 = tl.load(x + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the sum is rounded to the residual's dtype first, like the torch path's x + residual
        r_ptr = residual + t * stride_rt + h * stride_rh + cols
        r32 = tl.load(r_ptr, mask=mask, other=0.0).to(tl.float32)
        total = (x32 + r32).to(residual.dtype.element_ty)
        tl.store(r_ptr, total, mask=mask)
        x32 = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    # rounded before the weight multiply, as in the reference: weight * normed.to(dtype)
    normed = (x32 * rstd).to(out.dtype.element_ty).to(tl.float32)
    o_ptr = out + t * stride_ot + h * stride_oh + cols
    tl.store(o_ptr, (w * normed).to(out.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> None:
    x3, o3 = _as_rows(x), _as_rows(out)
    r3 = x3 if residual is None else _as_rows(residual)  # unused when there is no residual
    tokens, heads, n = x3.shape
    assert weight.shape == (n,) and weight.is_contiguous(), (
        f"rms_norm weight {tuple(weight.shape)} does not match rows of {n}"
    )
    if tokens * heads == 0:
        return
    block = triton.next_power_of_2(n)
    launch = pdl.options(x.device)
    _rms_norm_kernel[(tokens * heads,)](
        x3,
        r3,
        o3,
        weight,
        eps,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        o3.stride(0),
        o3.stride(1),
        HEADS=heads,
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        **launch,
        num_warps=_num_warps(block),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, N] or [T, H, N] (any token/head strides) -> new
    contiguous tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, out, weight, eps)
    return out


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual <- x + residual, then x <- rms_norm(residual)."""
    assert x.shape == residual.shape and x.dtype == residual.dtype, (
        f"add_rms_norm_: x {tuple(x.shape)} {x.dtype} vs residual "
        f"{tuple(residual.shape)} {residual.dtype}"
    )
    _launch_rms_norm(x, residual, x, weight, eps)


@triton.jit
def rope_halves(
    x1, x2, cos, sin, norm_w, offs_d, d_mask, eps, HALF: tl.constexpr, NORM: tl.constexpr, dtype
):
    """Neox RoPE of heads given as their halves x1, x2 [heads, BLOCK_D] (float32): (the
    per-head RMSNorm first when NORM,) -> the rotated halves, rounded to `dtype` as the
    unfused path stores them (returned in float32)."""
    if NORM:  # rounded like rms_norm(): normalised, to dtype, times the weight, to dtype
        inv = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_w + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype).to(tl.float32)
    y2 = (x2 * cos + x1 * sin).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def rotate_heads(
    x,  # this token's first head
    stride_h,
    dst,  # where the rotated heads go: x itself (in place) or a KV-pool slot
    stride_dh,
    cos,  # [1, BLOCK_D] float32
    sin,
    offs_d,
    d_mask,
    norm_w,  # [2 * HALF] per-head RMSNorm weight (Qwen3's q/k norm), used when NORM
    eps,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < HEADS)[:, None] & d_mask[None, :]
    first = x + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rope_halves(
        x1, x2, cos, sin, norm_w, offs_d, d_mask, eps, HALF, NORM, x.dtype.element_ty
    )
    out = dst + offs_h[:, None] * stride_dh + offs_d[None, :]
    dst_dtype = dst.dtype.element_ty
    tl.store(out, y1.to(dst_dtype), mask=mask)
    tl.store(out + HALF, y2.to(dst_dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q,
    k,
    cos_sin,  # [max_position, 2 * HALF] float32: cos | sin
    positions,
    stride_pos,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    q_norm_w,
    k_norm_w,
    eps,
    # used when STORE: k goes to k_pool, v to v_pool at slot out_loc[t] instead of k in place
    v,
    stride_vt,
    stride_vh,
    k_pool,  # [slots, K_HEADS, 2 * HALF], v_pool with the same strides
    v_pool,
    out_loc,
    stride_loc,
    stride_ps,
    stride_ph,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)  # one program per token: all its q and k heads
    pos = tl.load(positions + t * stride_pos).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    row = cos_sin + pos * (2 * HALF)
    cos = tl.load(row + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(row + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    q_t, k_t = q + t * stride_qt, k + t * stride_kt
    rotate = (cos, sin, offs_d, d_mask)
    rotate_heads(
        q_t, stride_qh, q_t, stride_qh, *rotate, q_norm_w, eps, Q_HEADS, BLOCK_QH, HALF, NORM
    )
    if STORE:
        slot = tl.load(out_loc + t * stride_loc).to(tl.int64)
        k_dst, stride_dh = k_pool + slot * stride_ps, stride_ph
    else:
        k_dst, stride_dh = k_t, stride_kh
    rotate_heads(
        k_t, stride_kh, k_dst, stride_dh, *rotate, k_norm_w, eps, K_HEADS, BLOCK_KH, HALF, NORM
    )
    if STORE:  # v as it is, in the two halves that the masks above cover
        offs_h = tl.arange(0, BLOCK_KH)[:, None]
        mask = (offs_h < K_HEADS) & d_mask[None, :]
        src = v + t * stride_vt + offs_h * stride_vh + offs_d[None, :]
        dst = v_pool + slot * stride_ps + offs_h * stride_ph + offs_d[None, :]
        dtype = v_pool.dtype.element_ty
        tl.store(dst, tl.load(src, mask=mask).to(dtype), mask=mask)
        tl.store(dst + HALF, tl.load(src + HALF, mask=mask).to(dtype), mask=mask)


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Neox-style rotary embedding of q [T, Hq, D] and k [T, Hk, D] in place (they may be strided
    views of the fused qkv output); positions [T] int32/int64 index cos_sin [max_pos, D].
    With qk_norm = (q weight, k weight, eps), each head is first RMS-normalised (Qwen3), as
    rms_norm() would, in the same pass."""
    _launch_rotary(q, k, cos_sin, positions, qk_norm, None)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out_loc: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """rotary_() of q in place, and of k straight into the KV pool: k_pool[out_loc[t]] =
    rotated k[t], v_pool[out_loc[t]] = v[t] (cast to the pool's dtype), all in one launch that
    replaces rotary_() + store_kv(). k and v are only read. Pools [slots, Hk, D] with one
    layout; out_loc [T] int32/int64."""
    tokens, heads, dim = k.shape
    assert v.shape == k.shape and k_pool.shape[1:] == (heads, dim), (
        f"rotary_store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, pool {tuple(k_pool.shape)}"
    )
    assert k_pool.stride() == v_pool.stride() and k_pool.dtype == v_pool.dtype
    assert v.stride(2) == 1 and k_pool.stride(2) == 1, "rotary_store_kv: unit last strides"
    assert out_loc.shape == (tokens,), f"rotary_store_kv: out_loc {tuple(out_loc.shape)}"
    _launch_rotary(q, k, cos_sin, positions, qk_norm, (v, k_pool, v_pool, out_loc))


def _launch_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    tokens, q_heads, dim = q.shape
    assert k.dim() == 3 and k.shape[0] == tokens and k.shape[2] == dim, (
        f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} disagree"
    )
    assert positions.shape == (tokens,), f"rotary: positions {tuple(positions.shape)}, T={tokens}"
    assert q.stride(2) == 1 and k.stride(2) == 1, "rotary: q and k need a unit last stride"
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
    assert cos_sin.shape[1] == dim and dim % 2 == 0, f"rotary: cos_sin {tuple(cos_sin.shape)}"
    if tokens == 0:
        return
    v, k_pool, v_pool, out_loc = store or (k, k, k, positions)  # unused when there is no store
    half = dim // 2
    launch = pdl.options(q.device)
    _rotary_kernel[(tokens,)](
        q,
        k,
        cos_sin,
        positions,
        positions.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *(qk_norm or (q, k, 0.0)),  # unused pointers when there is no norm
        v,
        v.stride(0),
        v.stride(1),
        k_pool,
        v_pool,
        out_loc,
        out_loc.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        Q_HEADS=q_heads,
        K_HEADS=k.shape[1],
        BLOCK_QH=triton.next_power_of_2(q_heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        HALF=half,
        BLOCK_D=triton.next_power_of_2(half),
        NORM=qk_norm is not None,
        STORE=store is not None,
        **launch,
        num_warps=4,
    )


@triton.jit
def _silu_and_mul_kernel(
    x, out, stride_xt, stride_ot, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + t * stride_xt + N + cols, mask=mask, other=0.0).to(tl.float32)
    res = gate * tl.sigmoid(gate) * up
    tl.store(out + t * stride_ot + cols, res.to(out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    assert x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1, (
        f"silu_and_mul needs an even last dim with unit stride, got {tuple(x.shape)}"
    )
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)  # a view for the [T, 2I] GEMM outputs this sees
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and n > 0:
        block = min(1024, triton.next_power_of_2(n))
        launch = pdl.options(x.device)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            N=n,
            BLOCK=block,
            **launch,
            num_warps=_num_warps(block),
        )
    return out.view(*x.shape[:-1], n)


@triton.jit
def _store_kv_kernel(
    k,
    v,
    k_pool,  # [slots, HEADS, DIM]
    v_pool,
    out_loc,
    stride_loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ps,
    stride_ph,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)  # one program per token: its K and V, all heads
    slot = tl.load(out_loc + t * stride_loc).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < HEADS) & (offs_d < DIM)
    dst = slot * stride_ps + offs_h * stride_ph + offs_d
    dtype = k_pool.dtype.element_ty
    kt = tl.load(k + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    tl.store(k_pool + dst, kt.to(dtype), mask=mask)
    vt = tl.load(v + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(v_pool + dst, vt.to(dtype), mask=mask)


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_pool[out_loc[t]] = k[t] and v_pool[out_loc[t]] = v[t] (cast to the pool's dtype);
    pools [slots, Hk, D] with one layout, k / v [T, Hk, D] with any token/head strides."""
    tokens, heads, dim = k.shape
    assert v.shape == k.shape and k_pool.shape[1:] == (heads, dim), (
        f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, pool {tuple(k_pool.shape)}"
    )
    assert k_pool.stride() == v_pool.stride() and k_pool.dtype == v_pool.dtype
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_pool.stride(2) == 1
    assert out_loc.shape == (tokens,), f"store_kv: out_loc {tuple(out_loc.shape)}, T={tokens}"
    if tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    launch = pdl.options(k.device)
    _store_kv_kernel[(tokens,)](
        k,
        v,
        k_pool,
        v_pool,
        out_loc,
        out_loc.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        HEADS=heads,
        DIM=dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        **launch,
        num_warps=_num_warps(block_h * block_d),
    )


@triton.jit
def kv_slots(page_table, row, pos, mask, stride_pt, PAGE_SIZE: tl.constexpr):
    """int64 pool slots of positions `pos` of page-table row `row` (masked lanes read page 0):
    `Context.kv_slots` inside a kernel (here and the attention kernels)."""
    page = tl.load(page_table + row * stride_pt + pos // PAGE_SIZE, mask=mask, other=0)
    return page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE


@triton.jit
def _decode_inputs_kernel(
    token_table,  # [rows, positions] token ids
    page_table,  # [rows, pages] page ids
    rows,  # [B]
    positions,  # [B]
    input_ids,  # [B] out, token_table's dtype
    out_loc,  # [B] int64 out: the KV-pool slot
    batch,
    stride_tokens,
    stride_pages,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < batch
    row = tl.load(rows + offs, mask=mask, other=0).to(tl.int64)
    pos = tl.load(positions + offs, mask=mask, other=0).to(tl.int64)
    token = tl.load(token_table + row * stride_tokens + pos, mask=mask)
    tl.store(input_ids + offs, token, mask=mask)
    tl.store(
        out_loc + offs, kv_slots(page_table, row, pos, mask, stride_pages, PAGE_SIZE), mask=mask
    )


def decode_inputs(
    token_table: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's (input_ids, out_loc) in one launch: token_table[rows, positions] and
    the KV slot of each (row, position), page_table[rows, positions // page_size] * page_size
    + positions % page_size (`Context.kv_slots`), which take seven small torch kernels."""
    assert token_table.stride(1) == 1 and page_table.stride(1) == 1
    assert rows.dim() == 1 and positions.shape == rows.shape, (rows.shape, positions.shape)
    rows, positions = rows.contiguous(), positions.contiguous()  # no copy for a block's rows
    batch = rows.shape[0]
    input_ids = torch.empty(batch, dtype=token_table.dtype, device=rows.device)
    out_loc = torch.empty(batch, dtype=torch.int64, device=rows.device)
    block = min(1024, triton.next_power_of_2(max(batch, 1)))
    _decode_inputs_kernel[(triton.cdiv(batch, block),)](
        token_table, page_table, rows, positions, input_ids, out_loc, batch,
        token_table.stride(0), page_table.stride(0),
        PAGE_SIZE=page_size, BLOCK=block, num_warps=max(1, min(4, block // 32)),
    )  # fmt: skip
    return input_ids, out_loc


@triton.jit(do_not_specialize=["n", "n_pages"])
def _write_entries_kernel(
    page_table, token_table, entries, n, n_pages, stride_pages, stride_tokens, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = tl.load(entries + offs, mask=mask, other=0).to(tl.int64)
    col = tl.load(entries + n + offs, mask=mask, other=0).to(tl.int64)
    value = tl.load(entries + 2 * n + offs, mask=mask, other=0)
    page = offs < n_pages
    tl.store(page_table + row * stride_pages + col, value, mask=mask & page)
    tl.store(token_table + row * stride_tokens + col, value, mask=mask & ~page)


def write_table_entries(
    page_table: torch.Tensor, token_table: torch.Tensor, entries: torch.Tensor, n_pages: int
) -> None:
    """entries [3, n] int32 (row, column, value): the first n_pages into the page table, the
    rest into the token table, in one launch (the engine's queued `TableWrites`). n and
    n_pages vary every step: not specialised on, so no new variant compiles mid-run."""
    assert entries.dtype == page_table.dtype == token_table.dtype == torch.int32
    assert entries.is_contiguous() and entries.shape[0] == 3
    assert page_table.stride(1) == 1 and token_table.stride(1) == 1
    n = entries.shape[1]
    block = 256
    _write_entries_kernel[(triton.cdiv(n, block),)](
        page_table, token_table, entries, n, n_pages, page_table.stride(0),
        token_table.stride(0), BLOCK=block, num_warps=4,
    )  # fmt: skip
