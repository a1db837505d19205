"""Random paged-attention problems for comparing attention backends (GPU tests and the CPU
Triton-interpreter check)."""

from __future__ import annotations

import random

import torch

from minisgl.attention import BaseAttnBackend, create_attention_backend
from minisgl.core import Batch, Context, Req, SamplingParams, get_global_ctx, set_global_ctx
from minisgl.kvcache import MHAKVCache


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
    backend.store_kv(0, k, v, batch)
    return backend.forward(q, 0, q.shape[-1] ** -0.5, batch)


def max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"dtype {out.dtype} != reference {ref.dtype}"
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return (out.float() - ref.float()).abs().max().item()
