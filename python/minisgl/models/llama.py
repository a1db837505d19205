"""The Llama decoder, which every supported architecture specialises through ModelConfig:
QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3), mixture-of-experts MLPs (Qwen3-MoE)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import kernel
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.base import Module
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.layers.moe import MoELayer
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig


class Attention(Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        qk_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            qk_norm = (self.q_norm, self.k_norm)
        self.attn = AttentionLayer(layer_id, cfg.head_dim, rotary, qk_norm)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = p(x).split_with_sizes([p.q_size, p.kv_size, p.kv_size], dim=-1)
        return self.o_proj(self.attn(positions, q, k, v))


class MLP(Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13 = self.gate_up_proj.weight
        if (ops := kernel.gemv_ops(x, w13)) is not None:  # decode: SiLU in the GEMV's epilogue
            return self.down_proj(ops.gemv_silu_and_mul(x, w13, self.gate_up_proj.bias))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe is not None and layer_id in cfg.moe.sparse_layers:
            self.mlp: nn.Module = MoELayer(cfg.hidden_size, cfg.moe)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(Module):
    """The decoder (`model`) and the LM head (`compute_logits`), which the engine runs apart."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] (the model's output, normed) -> logits [N, vocab]."""
        return self.lm_head(hidden)
