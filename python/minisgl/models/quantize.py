"""`--quantization`: swap a loaded model's linear layers (and LM head) for weight-only quantized
ones (`layers/quantized.py`).

- `gguf`: from a GGUF's own blocks (`gguf_quant.py`): a projection whose parts are all Q4_0 /
  Q4_1 becomes an `Int4Linear` with the file's codes (when its rows are a multiple of 16, as
  the packing needs); any other (Q8_0, float) an `Int8Linear`, quantized per row from the
  GGUF's exact float32 values (or the loaded weights, for float tensors).
- `int8`: every projection an `Int8Linear`, quantized per row from the loaded weights.
The embedding table stays dense (a lookup reads one row per token)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import LinearBase
from minisgl.layers.quantized import (
    INT4_OFFSET,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    int4_fits,
)
from minisgl.models.gguf_quant import BLOCK, Blocks, load_blocks

MODES = ("auto", "none", "gguf", "int8")
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_parts(name: str, tied: bool) -> list[str]:
    """The checkpoint weights merged into module `name` (in order)."""
    if name == "lm_head" and tied:
        return ["model.embed_tokens.weight"]
    prefix, _, leaf = name.rpartition(".")
    return [f"{prefix}.{part}.weight" for part in _MERGED.get(leaf, (leaf,))]


def int4_from_blocks(parts: list[Blocks], dtype: torch.dtype) -> Int4Linear:
    """Q4_0 / Q4_1 blocks (rows concatenated) as torch's int4 layout, codes unchanged:
    Q4_0 w = d (q - 8): scale d, zero 0; Q4_1 w = d q + m = d (q - 8) + (m + 8 d)."""
    codes = torch.cat([b.codes for b in parts])
    scales = torch.cat([b.scales.float() for b in parts])
    zeros = torch.cat(
        [
            torch.zeros_like(b.scales.float())
            if b.mins is None
            else b.mins.float() + INT4_OFFSET * b.scales.float()
            for b in parts
        ]
    )
    return Int4Linear(codes, scales.to(dtype), zeros.to(dtype))


def _quantize_one(
    module: nn.Module, parts: list[Blocks | None], mode: str, dtype: torch.dtype
) -> QuantizedLinear:
    four_bit = [b for b in parts if b is not None and b.kind in ("Q4_0", "Q4_1")]
    if mode == "gguf" and four_bit and len(four_bit) == len(parts):
        rows = sum(b.codes.shape[0] for b in four_bit)
        if int4_fits(rows, four_bit[0].codes.shape[1], BLOCK):
            return int4_from_blocks(four_bit, dtype)
    if mode == "gguf" and all(b is not None for b in parts):
        exact = torch.cat([b.dequantize() for b in parts if b is not None])
        return Int8Linear.from_float(exact, dtype)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return Int8Linear.from_float(weight, dtype)


def quantize_model(model: nn.Module, model_dir: str, mode: str, dtype: torch.dtype) -> int:
    """Quantize the model's projections in place (mode `gguf` or `int8`); -> how many."""
    blocks = load_blocks(model_dir) if mode == "gguf" else {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, (LinearBase, ParallelLMHead)):
            continue
        parts = [blocks.get(p) for p in checkpoint_parts(name, tied)]
        with torch.no_grad():
            module.quantized = _quantize_one(module, parts, mode, dtype)
        if isinstance(module, LinearBase):  # the LM head's weight may be the embedding's
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        count += 1
    return count
