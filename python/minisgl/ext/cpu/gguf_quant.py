"""GGUF's quantized blocks as tensors: the codes, scales and minimums of Q4_0, Q4_1 and Q8_0,
split out of llama.cpp's block layout, read from the GGUF file itself (the conversion lists
these tensors in `gguf-blocks.json` and writes no copy of them), so that `--quantization gguf`
builds its int4 / int8 layers from the file's own codes: once, as it then caches them packed.

Block layouts (32 weights each, little endian):
- Q4_0: float16 d, 16 bytes of nibbles; w = d (q - 8)
- Q4_1: float16 d, float16 m, 16 bytes of nibbles; w = d q + m
- Q8_0: float16 d, 32 int8; w = d q
Nibbles: byte j holds weight j in its low half and weight j + 16 in its high half."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minisgl.ext.cpu.gguf import quantized_names, source_tensors, unpermute

BLOCK = 32
KINDS = ("Q4_0", "Q4_1", "Q8_0")


@dataclass
class Blocks:
    """One tensor's blocks: codes [rows, cols] (uint8 0..15 or int8), scales and mins
    [rows, cols / 32] float16 (mins only for Q4_1)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def permute_rows(self, fn: Any) -> Blocks:
        mins = None if self.mins is None else fn(self.mins)
        return Blocks(self.kind, fn(self.codes), fn(self.scales), mins)

    def dequantize(self) -> torch.Tensor:
        """float32 weights, computed as the gguf package does (bit for bit)."""
        d = self.scales.float().unsqueeze(-1)
        q = self.codes.float().unflatten(1, (-1, BLOCK))
        if self.kind == "Q4_0":
            w = d * (q - 8)
        elif self.kind == "Q4_1":
            assert self.mins is not None
            w = d * q + self.mins.float().unsqueeze(-1)
        else:
            w = q * d
        return w.flatten(1)


def split_blocks(tensor: Any) -> Blocks | None:
    """The blocks of a GGUF tensor of a kind in KINDS, else None."""
    kind = tensor.tensor_type.name
    if kind not in KINDS:
        return None
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[0]
    head = 4 if kind == "Q4_1" else 2
    blocks = raw.reshape(rows, -1, head + (BLOCK if kind == "Q8_0" else BLOCK // 2))
    scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
    mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]) if head == 4 else None
    body = blocks[..., head:]
    if kind == "Q8_0":
        codes = torch.from_numpy(body.copy().view(np.int8).reshape(rows, -1))
    else:
        nibbles = np.concatenate([body & 0x0F, body >> 4], axis=-1)
        codes = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(rows, -1))
    return Blocks(kind, codes, scales, mins)


def load_blocks(model_dir: str) -> dict[str, Blocks]:
    """HF parameter name -> its GGUF blocks, read from the GGUF file of a conversion (in HF's
    row order); empty when the model has none (not a GGUF, or no tensor of a kind in KINDS)."""
    names = quantized_names(model_dir)
    out = {}
    for name, tensor, heads in source_tensors(model_dir) if names else []:
        blocks = split_blocks(tensor) if name in names else None
        if blocks is not None:
            out[name] = blocks.permute_rows(lambda t, h=heads: unpermute(t, h)) if heads else blocks
    return out
