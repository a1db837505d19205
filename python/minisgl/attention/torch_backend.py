"""Reference attention in plain torch: each request's KV gathered, padded, masked SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import BaseAttnBackend
from minisgl.context import get_global_ctx
from minisgl.core import AttnMetadata, Batch


@dataclass
class TorchAttnMetadata(AttnMetadata):
    kv_slots: torch.Tensor  # [B, max_kv_len] KV slot of each position (garbage where masked)
    mask: torch.Tensor | None  # [B, 1, max_q_len, max_kv_len] True where allowed; None: all
    q_index: torch.Tensor  # [num_tokens] row of each token in the flattened [B * max_q_len]
    max_q_len: int


class TorchAttnBackend(BaseAttnBackend):
    name = "torch"

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def prepare(self, batch: Batch) -> None:
        ctx, window = get_global_ctx(), self.sliding_window
        device = ctx.page_table.device
        per_req = [(r.cached_len, r.extend_len, r.table_idx) for r in batch.reqs]
        cached, extend, rows = torch.tensor(per_req, device=device).T
        max_q = max(r.extend_len for r in batch.reqs)
        kv_lens = {r.cached_len + r.extend_len for r in batch.reqs}
        max_kv = max(kv_lens)

        kv_pos = torch.arange(max_kv, device=device)
        pages = ctx.page_table[rows[:, None], (kv_pos // ctx.page_size)[None, :]].long()
        kv_slots = pages * ctx.page_size + kv_pos % ctx.page_size

        q_off = torch.arange(max_q, device=device)
        q_pos = cached[:, None] + q_off[None, :]  # [B, max_q]
        q_valid = q_off[None, :] < extend[:, None]
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]
        if window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - window
        mask &= q_valid[:, :, None]
        mask[:, :, 0] |= ~q_valid  # padded query rows attend to one slot instead of none (NaN)
        q_index = torch.nonzero(q_valid.flatten()).squeeze(1)
        # decode rows of one length see every slot: SDPA without a mask is the cheaper kernel
        unmasked = max_q == 1 and len(kv_lens) == 1 and (window is None or max_kv <= window)
        full = None if unmasked else mask.unsqueeze(1)
        batch.attn_metadata = TorchAttnMetadata(kv_slots, full, q_index, max_q)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: Batch) -> torch.Tensor:
        md = TorchAttnMetadata.of(batch)
        kv_cache = get_global_ctx().kv_cache
        keys = gather_kv(kv_cache.k_flat(layer_id), md.kv_slots, q.dtype)
        values = gather_kv(kv_cache.v_flat(layer_id), md.kv_slots, q.dtype)
        bsz, (_, heads, dim) = md.kv_slots.shape[0], q.shape
        if md.max_q_len == 1:  # decode: one token per request, no padding to build
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=md.mask, scale=scale, enable_gqa=True
            )
            return out.squeeze(2)
        padded = q.new_zeros(bsz * md.max_q_len, heads, dim)
        padded[md.q_index] = q
        padded = padded.view(bsz, md.max_q_len, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            padded, keys, values, attn_mask=md.mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(bsz * md.max_q_len, heads, dim)[md.q_index]


def gather_kv(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hk, L, D] of the pool's rows at `slots` [B, L], in `dtype` (an fp8 pool widened)."""
    # Converted while contiguous: a strided conversion costs more than the attention.
    # index_select along dim 0: half the CPU time of advanced indexing at decode sizes, and
    # several times faster than along another dim (K and V at once).
    rows = pool.index_select(0, slots.reshape(-1)).to(dtype)
    return rows.view(*slots.shape, *pool.shape[1:]).transpose(1, 2)
