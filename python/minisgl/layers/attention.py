from __future__ import annotations

import torch

from minisgl import kernel
from minisgl.context import get_global_ctx
from minisgl.core import Batch
from minisgl.kernel import DecodeRope
from minisgl.layers.base import Module
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding


class AttentionLayer(Module):
    """One layer's paged attention: (per-head q/k RMSNorm: Qwen3,) RoPE on the new tokens, their
    k and v into the KV pool, then the context's backend attends q to the pool."""

    def __init__(
        self,
        layer_id: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qk_norm: tuple[RMSNorm, RMSNorm] | None,
    ) -> None:
        super().__init__()
        self.layer_id, self.head_dim, self.scale = layer_id, head_dim, head_dim**-0.5
        # held, not registered: the model owns them (one rotary for every layer)
        self.rotary, self.qk_norm = [rotary], qk_norm

    def qk_norm_args(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q weight, k weight, eps) of the per-head q/k RMSNorm for the fused kernels."""
        norms = self.qk_norm
        return None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)

    def rope_store_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: Batch,
    ) -> torch.Tensor:
        """(q/k norm,) RoPE and the K/V write of q, k, v [T, heads, head_dim] -> the rotated q."""
        ctx, norms = get_global_ctx(), self.qk_norm
        if (ops := kernel.fused_ops(q)) is not None:  # one kernel; q rotated in place
            assert batch.out_loc is not None
            k_pool, v_pool = ctx.kv_cache.k_flat(self.layer_id), ctx.kv_cache.v_flat(self.layer_id)
            cos_sin, out_loc, qk_norm = self.rotary[0].cos_sin, batch.out_loc, self.qk_norm_args()
            ops.rotary_store_kv(q, k, v, cos_sin, positions, k_pool, v_pool, out_loc, qk_norm)
            return q
        if norms is not None:
            q, k = norms[0].norm(q), norms[1].norm(k)
        q, k = self.rotary[0](positions, q, k)
        assert batch.out_loc is not None
        ctx.kv_cache.store(self.layer_id, batch.out_loc, k, v)
        return q

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, heads * head_dim], k and v [T, kv_heads * head_dim] (views of the QKV
        projection's output, which the fused path rotates in place) -> [T, heads * head_dim]."""
        ctx = get_global_ctx()
        batch, backend = ctx.batch, ctx.attn_backend
        assert batch is not None
        q, k, v = (x.view(x.shape[0], -1, self.head_dim) for x in (q, k, v))
        # a backend whose decode kernel does RoPE and the store itself (triton) gets q, k, v
        if kernel.fused_ops(q) is not None and backend.fuses_rope(batch):
            assert batch.out_loc is not None
            cos_sin, qk_norm = self.rotary[0].cos_sin, self.qk_norm_args()
            rope = DecodeRope(k, v, cos_sin, positions, batch.out_loc, qk_norm)
            out = backend.forward_rope(q, rope, self.layer_id, self.scale, batch)
        else:
            q = self.rope_store_kv(positions, q, k, v, batch)
            out = backend.forward(q, self.layer_id, self.scale, batch)
        return out.flatten(1)
