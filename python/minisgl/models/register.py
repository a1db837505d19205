from __future__ import annotations

from minisgl.models.config import ARCHITECTURES
from minisgl.models.llama import LlamaForCausalLM


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Every supported architecture (`ARCHITECTURES`) is the Llama decoder as its ModelConfig
    specialises it: QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3), routed experts in some
    layers (Qwen3-MoE), a sliding window (Mistral: the attention backend's)."""
    if architecture not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}")
    return LlamaForCausalLM
