from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every supported architecture is a LlamaForCausalLM
    from minisgl.models.llama import LlamaForCausalLM

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in _ARCHITECTURES:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}")
    module = importlib.import_module(f"minisgl.models.{_ARCHITECTURES[architecture]}")
    return getattr(module, architecture)
