"""Paged attention with the Triton kernels of `minisgl.kernel.triton_attention`: a split-KV
decode kernel and a causal extend (prefill) kernel, both reading KV through the page table."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, get_global_ctx


@dataclass
class TritonAttnMetadata:
    rows: torch.Tensor  # [B] int32 page-table row of each request
    cached_lens: torch.Tensor  # [B] int32 KV already in the pool before this forward
    extend_lens: torch.Tensor  # [B] int32 tokens this forward computes
    kv_lens: torch.Tensor  # [B] int32 cached + extend
    q_starts: torch.Tensor  # [B] int32 first token of each request in the flat q
    max_extend_len: int
    max_kv_len: int
    num_splits: int  # decode only: KV chunks per request


class TritonAttnBackend(BaseAttnBackend):
    def __init__(self, sliding_window: int | None = None) -> None:
        if sliding_window is not None:
            raise ValueError("the triton attention backend does not support sliding windows yet")
        from minisgl.kernel import triton_attention

        self.kernels = triton_attention

    def prepare(self, batch: Batch) -> None:
        ctx = get_global_ctx()
        reqs = batch.reqs
        cached = [r.cached_len for r in reqs]
        extend = [r.extend_len for r in reqs]
        kv_lens = [c + e for c, e in zip(cached, extend)]
        q_starts = [0, *accumulate(extend)][:-1]
        host = torch.tensor(
            [[r.table_idx for r in reqs], cached, extend, kv_lens, q_starts], dtype=torch.int32
        )
        dev = host.to(ctx.page_table.device, non_blocking=True)
        max_kv = max(kv_lens)
        splits = 1
        if batch.is_decode:
            splits = self.kernels.decode_splits(len(reqs), ctx.kv_cache.num_kv_heads, max_kv)
        batch.attn_metadata = TritonAttnMetadata(*dev, max(extend), max_kv, splits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scale: float,
        batch: Batch,
    ) -> torch.Tensor:
        md: TritonAttnMetadata = batch.attn_metadata
        ctx = get_global_ctx()
        kv_cache = ctx.kv_cache
        kv_cache.store(layer_id, batch.out_loc, k, v)
        k_pool, v_pool = kv_cache.k_flat(layer_id), kv_cache.v_flat(layer_id)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if batch.is_decode:
            return self.kernels.decode_attention(
                q,
                k_pool,
                v_pool,
                ctx.page_table,
                md.rows,
                md.kv_lens,
                md.max_kv_len,
                md.num_splits,
                ctx.page_size,
                scale,
            )
        return self.kernels.extend_attention(
            q,
            k_pool,
            v_pool,
            ctx.page_table,
            md.rows,
            md.q_starts,
            md.cached_lens,
            md.extend_lens,
            md.max_extend_len,
            ctx.page_size,
            scale,
        )
