from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.models.config import ModelConfig
from minisgl.models.weight import (
    default_model,
    init_dummy_weights,
    load_weights,
    resolve_model_path,
)

if TYPE_CHECKING:  # the model (torch) where it is built: ModelConfig is read without it
    from minisgl.models.llama import LlamaForCausalLM

__all__ = [
    "ModelConfig",
    "default_model",
    "get_model_class",
    "init_dummy_weights",
    "load_weights",
    "resolve_model_path",
]


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Every architecture `ModelConfig.from_hf` accepts (`config.ARCHITECTURES`) is the Llama
    decoder as its ModelConfig specialises it."""
    from minisgl.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
