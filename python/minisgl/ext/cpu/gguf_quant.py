"""GGUF's quantized blocks as tensors: the codes, scales and minimums of Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, split out of llama.cpp's block layout, read from the GGUF file
itself (the conversion lists these tensors in `gguf-blocks.json` and writes no copy of them),
so that `--quantization gguf` builds its int4 / int8 layers from the file's own codes: once, as
it then caches them packed.

Block layouts (little endian):
- Q4_0 (32 weights): float16 d, 16 bytes of nibbles; w = d (q - 8)
- Q4_1 (32): float16 d, float16 m, 16 bytes of nibbles; w = d q + m
- Q5_0, Q5_1 (32): Q4_0's, Q4_1's with 4 bytes of fifth bits before the nibbles (bit j: weight
  j's), q 0..31; w = d (q - 16), w = d q + m (the K-quants' fallback where rows are not 256s)
- Q8_0 (32): float16 d, 32 int8; w = d q
- Q4_K (256, the "K-quant" of most GGUF files, Q4_K_M's bulk): float16 d and dmin, 12 bytes
  of eight 6-bit (sc, m) pairs, 128 bytes of nibbles; sub-block k (32 weights) has
  w = (d sc_k) q - (dmin m_k). As 32-weight blocks its scale d sc_k and minimum -dmin m_k are
  float32 (exact products); `KScales` keeps the factors, which minisgl's kernel reads as they
  are (4 + 5/8 bits a weight; float16 rows of d sc and mn would take 5).
- Q5_K (256, Q5_K_M's bulk): Q4_K's fields and 32 bytes of fifth bits between the 6-bit pairs
  and the nibbles: bit k of byte j is sub-block k's weight j's; codes 0..31 (8-bit layers).
- Q6_K (256; Q4_K_M's and Q5_K_M's LM head, attn_v and half the ffn_down): 128 bytes of low
  nibbles, 64 of high bit pairs, 16 int8 scales sc, float16 d; each 16 weights have
  w = (d sc) (q - 32), q 0..63. Its scales stay per 16 weights, d sc in float32 (exact, as the
  gguf package computes it); minisgl's kernel takes them in its six-bit layout.
Nibbles: in Q4_0 / Q4_1 byte j holds weight j in its low half and weight j + 16 in its high
half; in Q4_K byte j of each 32 holds sub-block 2i's weight j low and sub-block 2i+1's high."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minisgl.ext.cpu.gguf import quantized_names, source_tensors, unpermute

BLOCK = 32
SUPER = 256  # a K-quant block's weights
KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
WITH_MINS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # w = d q + m; the others w = d q, or:
OFFSETS = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}  # w = d (q - offset): codes kept unsigned
K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # a 256-weight block's bytes


@dataclass
class KScales:
    """A K-quant's scales as the file has them: per 256 weights float16 d (and, Q4_K / Q5_K,
    m_scale = -dmin), per 32 weights (Q6_K: 16) int8 sc (and m): w = d sc (q - offset) +
    m_scale m."""

    d: torch.Tensor  # [rows, cols / 256] float16
    sc: torch.Tensor  # [rows, cols / 32 or cols / 16] int8
    m_scale: torch.Tensor | None = None  # [rows, cols / 256] float16
    m: torch.Tensor | None = None  # [rows, cols / 32] int8

    def permute_rows(self, fn: Any) -> KScales:
        mins = (None, None) if self.m is None else (fn(self.m_scale), fn(self.m))
        return KScales(fn(self.d), fn(self.sc), *mins)


@dataclass
class Blocks:
    """One tensor's blocks: codes [rows, cols] (uint8 0..15, 0..31, 0..63 or int8), scales
    and mins [rows, cols / 32] (float16, the K-quants' float32; mins only for WITH_MINS);
    Q6_K's scales [rows, cols / 16] float32. `k`: a K-quant's factors of those scales."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    k: KScales | None = None

    def permute_rows(self, fn: Any) -> Blocks:
        mins = None if self.mins is None else fn(self.mins)
        k = None if self.k is None else self.k.permute_rows(fn)
        return Blocks(self.kind, fn(self.codes), fn(self.scales), mins, k)

    def dequantize(self) -> torch.Tensor:
        """float32 weights, computed as the gguf package does (bit for bit)."""
        d = self.scales.float().unsqueeze(-1)
        q = self.codes.float().unflatten(1, (self.scales.shape[1], -1))
        if self.kind in OFFSETS:
            w = d * (q - OFFSETS[self.kind])
        elif self.kind in WITH_MINS:
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
    if kind == "Q6_K":
        return split_q6_k(raw.reshape(rows, -1, K_BYTES[kind]))
    if kind in K_BYTES:
        return split_k_quant(raw.reshape(rows, -1, K_BYTES[kind]), kind)
    head = (4 if kind in WITH_MINS else 2) + (4 if kind.startswith("Q5") else 0)
    blocks = raw.reshape(rows, -1, head + (BLOCK if kind == "Q8_0" else BLOCK // 2))
    scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
    with_mins = kind in WITH_MINS
    mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]) if with_mins else None
    body = blocks[..., head:]
    if kind == "Q8_0":
        codes = torch.from_numpy(body.copy().view(np.int8).reshape(rows, -1))
        return Blocks(kind, codes, scales, mins)
    nibbles = np.concatenate([body & 0x0F, body >> 4], axis=-1)
    if kind.startswith("Q5"):  # bit j of the little-endian word before the nibbles: weight j's
        word = blocks[..., head - 4 : head].copy().view(np.uint32)
        nibbles = nibbles | (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    return Blocks(
        kind, torch.from_numpy(np.ascontiguousarray(nibbles).reshape(rows, -1)), scales, mins
    )


def six_bit_pairs(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K block's eight (sc, m) from its 12 bytes [..., 12]: bytes 0-3 hold sc 0-3 in their
    low six bits, 4-7 m 0-3; bytes 8-11 hold the low four bits of sc 4-7 (low nibble) and m 4-7
    (high), whose top two bits are bytes 0-3's (sc) and 4-7's (m) top two."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (extra & 15) | ((low >> 6) << 4)], axis=-1)
    m = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, m


def split_k_quant(blocks: np.ndarray, kind: str) -> Blocks:
    """Q4_K / Q5_K blocks [rows, n, K_BYTES] as 32-weight blocks: codes in weight order, each
    sub-block's d sc and -dmin m (float32, exact), and their factors."""
    rows, n = blocks.shape[:2]
    d, dmin = (blocks[..., i : i + 2].copy().view(np.float16) for i in (0, 2))
    sc, m = six_bit_pairs(blocks[..., 4:16])
    scales = (d.astype(np.float32) * sc).reshape(rows, n * 8)
    mins = (-dmin.astype(np.float32) * m).reshape(rows, n * 8)
    k = KScales(
        torch.from_numpy(d[..., 0].copy()),
        torch.from_numpy(sc.reshape(rows, n * 8).astype(np.int8)),  # 0..63
        torch.from_numpy(-dmin[..., 0]),
        torch.from_numpy(m.reshape(rows, n * 8).astype(np.int8)),
    )
    qs = blocks[..., -128:].reshape(rows, n, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, n, 8, 32)
    if kind == "Q5_K":
        fifth = blocks[..., 16:48].reshape(rows, n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        codes = codes | ((fifth & 1) << 4)
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scales, mins)]
    return Blocks(kind, tensors[0].reshape(rows, n * SUPER), tensors[1], tensors[2], k)


def split_q6_k(blocks: np.ndarray) -> Blocks:
    """Q6_K blocks [rows, n, 210] as codes 0..63 in weight order and scales d sc per 16 weights
    (float32: exact). Each half of 128 weights has 64 bytes of nibbles and 32 of bit pairs:
    weight 32 j + l (j 0..3, l 0..31) is nibble (j // 2: high) of byte l + 32 (j % 2) with bits
    2 j, 2 j + 1 of its pair byte l."""
    rows, n = blocks.shape[:2]
    nibble_shifts, pair_shifts = (np.arange(0, 8, k, dtype=np.uint8)[:, None] for k in (4, 2))
    nibbles = blocks[..., :128].reshape(rows, n, 2, 1, 64) >> nibble_shifts
    low = (nibbles & np.uint8(15)).reshape(rows, n, 2, 4, 32)
    pairs = blocks[..., 128:192].reshape(rows, n, 2, 1, 32) >> pair_shifts
    codes = (low | ((pairs & np.uint8(3)) << np.uint8(4))).reshape(rows, n * SUPER)
    sc = blocks[..., 192:208].copy().view(np.int8)
    d = blocks[..., 208:210].copy().view(np.float16)
    scales = (d.astype(np.float32) * sc).reshape(rows, n * SUPER // 16)
    k = KScales(torch.from_numpy(d[..., 0].copy()), torch.from_numpy(sc.reshape(rows, -1).copy()))
    codes_t, scales_t = (torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scales))
    return Blocks("Q6_K", codes_t, scales_t, None, k)


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
