"""Random PEFT LoRA adapters for the tiny models of support/models.py, saved with PEFT's own
save_pretrained, and the merged transformers model each one gives (the reference)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from support.models import build_hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(arch: str, path: str, seed: int, **lora: Any) -> Any:
    """A LoRA adapter of the tiny `arch` model with random A and B (PEFT starts B at zero),
    saved in `path`; `lora`: LoraConfig fields (default r=8, alpha 16, every projection).
    -> the transformers model with the adapter merged in, for reference outputs."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": ALL, **lora})
    model = get_peft_model(build_hf_model(arch), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def edit_config(path: str, **changes: Any) -> None:
    """Change fields of the adapter's adapter_config.json (to make it bad)."""
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)
