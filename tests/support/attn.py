"""Random paged-attention problems for comparing attention backends (GPU tests and the CPU
Triton-interpreter check)."""

from __future__ import annotations

import random

import torch

from minisgl.attention import create_attention_backend
from minisgl.attention.base import BaseAttnBackend
from minisgl.context import Context, get_global_ctx, set_global_ctx
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache.pool import MHAKVCache


def make_problem(
    lens: list[tuple[int, int]],
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    decode: bool,
    device: torch.device,
    heads: int = 8,
    kv_heads: int = 2,
    spare_rows: int = 2,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,  # the pool's, if not dtype (fp8)
) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Set a global context whose pool holds random KV, each request's pages scattered over
    shuffled pages and its page-table row out of order, and return a batch of (cached_len,
    extend_len) requests with random q/k/v for its new tokens. Rows [0, spare_rows) are free
    and point at page 0, which no request uses (like the engine's padding row and page)."""
    gen = torch.Generator().manual_seed(seed * 7919 + page_size * 1000 + head_dim + len(lens))
    rng = random.Random(seed * 31 + len(lens) + page_size)
    max_len = max(c + e for c, e in lens)
    pages_per_req = -(-max_len // page_size)
    num_pages = len(lens) * pages_per_req + 1
    pool = MHAKVCache(1, num_pages, page_size, kv_heads, head_dim, kv_dtype or dtype, device)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    table = torch.zeros(len(lens) + spare_rows, pages_per_req, dtype=torch.int32)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    reqs, slots = [], []
    for i, (cached, extend) in enumerate(lens):
        row = len(lens) + spare_rows - 1 - i  # rows out of order
        table[row] = torch.tensor(free[i * pages_per_req : (i + 1) * pages_per_req])
        req = Req([0] * (cached + extend), cached + extend, SamplingParams(), cached + extend + 1)
        req.table_idx, req.cached_len, req.extend_len = row, cached, extend
        reqs.append(req)
        pos = torch.arange(cached, cached + extend)
        slots.append(table[row, pos // page_size].long() * page_size + pos % page_size)
    set_global_ctx(Context(page_size, table.to(device), pool, None))  # type: ignore[arg-type]
    batch = Batch(reqs, "decode" if decode else "prefill", out_loc=torch.cat(slots).to(device))
    tokens = sum(e for _, e in lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
    return batch, q, k, v


def run_backend(name: str, batch: Batch, q, k, v, sliding_window: int | None = None):
    """prepare + one layer's forward of a fresh backend; the output."""
    kv_dtype = get_global_ctx().kv_cache.dtype
    backend = create_attention_backend(
        name, q.device, sliding_window, dtype=q.dtype, num_qo_heads=q.shape[1], kv_dtype=kv_dtype
    )
    backend.prepare(batch)
    return attend(backend, batch, q, k, v)


def attend(backend: BaseAttnBackend, batch: Batch, q, k, v) -> torch.Tensor:
    """One layer (0) of a prepared backend, as the attention layer runs it: store the new
    tokens' k/v, then attend q to the pool."""
    get_global_ctx().kv_cache.store(0, batch.out_loc, k, v)
    return backend.forward(q, 0, q.shape[-1] ** -0.5, batch)


def max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"dtype {out.dtype} != reference {ref.dtype}"
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return (out.float() - ref.float()).abs().max().item()


def rope_inside_vs_rotary_kernel(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    norm: bool,
    lens: list[int],
    num_splits: int,
    device: torch.device,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    page_size: int = 4,
) -> tuple[float, bool]:
    """Decode of one new token per request (KV lengths `lens`, the new token's slot in a
    scattered page table) twice: the rotary kernel (q rotated in place, k and v stored) then
    `decode_attention`, and `decode_attention` given q before RoPE with a `DecodeRope`. Returns
    (max abs difference of the outputs, whether both pools are identical)."""
    from minisgl.kernel import DecodeRope, fused
    from minisgl.kernel import triton_attention as ta

    gen = torch.Generator().manual_seed(len(lens) * 101 + int(norm))
    pages = [-(-n // page_size) for n in lens]
    order = torch.randperm(sum(pages) + 3, generator=gen).to(torch.int32)  # 3 pages unused
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for i, n in enumerate(pages):
        table[i, :n] = order[sum(pages[:i]) : sum(pages[:i]) + n]
    slots = (sum(pages) + 3) * page_size
    pools = [torch.randn(slots, kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in "kv"]
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor(lens) - 1
    rows = torch.arange(len(lens))
    out_loc = table[rows, positions // page_size].long() * page_size + positions % page_size
    cos_sin = torch.randn(max(lens), head_dim, generator=gen)
    weights = torch.randn(2, head_dim, generator=gen).to(dtype)
    moved = [t.to(device) for t in (qkv, table, positions, out_loc, cos_sin, weights, *pools)]
    qkv, table, positions, out_loc, cos_sin, weights, k_pool, v_pool = moved
    qk_norm = (weights[0], weights[1], 1e-6) if norm else None
    q, k, v = (  # strided views of one projection output, as the model passes them
        t.view(len(lens), -1, head_dim)
        for t in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    )
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (table, rows.to(device, torch.int32), kv_lens, num_splits, page_size, head_dim**-0.5)
    k_a, v_a = k_pool.clone(), v_pool.clone()
    q_a = q.clone()
    fused.rotary_store_kv(q_a, k, v, cos_sin, positions, k_a, v_a, out_loc, qk_norm)
    tiles = ta.decode_tuning(k_pool, num_splits, rope=True)  # the same chunks: bit for bit
    out_a = ta.decode_attention(q_a, k_a, v_a, *args, tuning=tiles)
    k_b, v_b = k_pool.clone(), v_pool.clone()
    rope = DecodeRope(k, v, cos_sin, positions, out_loc, qk_norm)
    out_b = ta.decode_attention(q, k_b, v_b, *args, rope=rope)
    same = torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
    return (out_a.float() - out_b.float()).abs().max().item(), same
