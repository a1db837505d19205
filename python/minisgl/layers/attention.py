from __future__ import annotations

import torch
from torch import nn

from minisgl.core import get_global_ctx


class AttentionLayer(nn.Module):
    """Hands q/k/v to the context's attention backend, which also writes k/v to the KV pool;
    a layer whose kernel already wrote them (`kv_destination`) passes k = v = None."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def kv_destination(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K pool, V pool) of this layer as [slots, kv_heads, head_dim] and the current batch's
        write slots `out_loc` [T]: where a fused kernel puts this forward's k/v."""
        ctx = get_global_ctx()
        kv_cache = ctx.kv_cache
        return kv_cache.k_flat(self.layer_id), kv_cache.v_flat(self.layer_id), ctx.batch.out_loc

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        ctx = get_global_ctx()
        return ctx.attn_backend.forward(q, k, v, self.layer_id, self.scale, ctx.batch)
