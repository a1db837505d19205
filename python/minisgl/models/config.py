"""ModelConfig: the few facts the model code needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.layers.config import MoEConfig, RopeConfig

ARCHITECTURES = (  # HF `architectures` names: each is models/llama.py's decoder
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig  # rope.max_position: the model's context (HF max_position_embeddings)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    moe: MoEConfig | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @staticmethod
    def from_hf(hf: Any) -> ModelConfig:
        arch = (getattr(hf, "architectures", None) or [""])[0]
        if arch not in ARCHITECTURES:
            supported = ", ".join(ARCHITECTURES)
            raise ValueError(f"unsupported architecture {arch!r}; supported: {supported}")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        max_pos = getattr(hf, "max_position_embeddings", 4096)
        # transformers >= 5: rope_parameters (rope_theta inside); before: rope_scaling, rope_theta
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
        scaling = dict(params or {})
        base = float(scaling.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope = RopeConfig(head_dim, base, max_pos, scaling)
        window = getattr(hf, "sliding_window", None)
        if arch.startswith("Qwen") and not getattr(hf, "use_sliding_window", False):
            window = None
        return ModelConfig(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope=rope,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch.startswith("Qwen2") or bool(getattr(hf, "attention_bias", False)),
            qk_norm=arch.startswith("Qwen3"),
            sliding_window=window,
            moe=_moe_config(hf) if arch == "Qwen3MoeForCausalLM" else None,
            eos_token_ids=token_ids(getattr(hf, "eos_token_id", None)),
        )


def _moe_config(hf: Any) -> MoEConfig:
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", []) or [])
    sparse = tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return MoEConfig(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        sparse_layers=sparse,
    )


def token_ids(value: Any) -> tuple[int, ...]:
    """A config's token id field (None, one id or a list) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)
