"""The layers' configurations, read from a model's config (`models.config.ModelConfig`), apart
from the layers' modules: the tokenizer workers and the API process build them without torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    base: float = 10000.0
    max_position: int = 4096
    scaling: dict = field(default_factory=dict)  # HF rope_scaling / rope_parameters


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # layer ids using experts; the rest use the dense MLP
    backend: str = "torch"  # expert kernel: torch | triton; the engine sets it (--moe-backend)
