from __future__ import annotations

import torch

from minisgl import kernel
from minisgl.context import get_global_ctx
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

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, heads * head_dim], k and v [T, kv_heads * head_dim] (views of the QKV
        projection's output, which the fused path rotates in place) -> [T, heads * head_dim]."""
        ctx = get_global_ctx()
        batch, backend, layer = ctx.batch, ctx.attn_backend, self.layer_id
        assert batch is not None and batch.out_loc is not None
        q, k, v = (x.view(x.shape[0], -1, self.head_dim) for x in (q, k, v))
        norms = self.qk_norm
        if (ops := kernel.fused_ops(q)) is not None:
            cos_sin = self.rotary[0].cos_sin
            qk_norm = None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps)
            if backend.fuses_rope(batch):  # the decode kernel does RoPE and the store (triton)
                rope = DecodeRope(k, v, cos_sin, positions, batch.out_loc, qk_norm)
                return backend.forward_rope(q, rope, layer, self.scale, batch).flatten(1)
            # one kernel: (q/k norm,) RoPE, q rotated in place, k and v into the pool
            k_pool, v_pool = ctx.kv_cache.k_flat(layer), ctx.kv_cache.v_flat(layer)
            ops.rotary_store_kv(q, k, v, cos_sin, positions, k_pool, v_pool, batch.out_loc, qk_norm)
        else:
            if norms is not None:
                q, k = norms[0].norm(q), norms[1].norm(k)
            q, k = self.rotary[0](positions, q, k)
            ctx.kv_cache.store(layer, batch.out_loc, k, v)
        return backend.forward(q, layer, self.scale, batch).flatten(1)
