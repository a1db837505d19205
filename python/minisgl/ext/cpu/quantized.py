"""Weight-only quantized linear layers on CPU.

`QuantizedLinear` holds the quantized weight of one (possibly merged) projection and computes
y = x W^T in the activation dtype. Where minisgl's own kernel runs (`native.py`: AVX512-VNNI,
AVX-VNNI or AVX2), a GGUF's blocks become a `VnniLinear`: the file's codes and fp16 scales in
the kernel's tiled layout, 2-4x faster than the formats below at decode sizes (AVX2: 1.7-2.4x).
Elsewhere, on PyTorch's kernels:

- `Int4Linear`: 4-bit codes in groups along the input dimension, each group with a scale and a
  zero point: w = (q - 8) * scale + zero, torch's int4 "tinygemm" convention
  (`torch._weight_int4pack_mm_for_cpu`). GGUF Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m) map
  onto it with their codes unchanged: scale = d, zero = 0 or m + 8 d.
- `Int8SplitLinear`: 8-bit codes in groups (GGUF Q8_0) on the same int4 kernel, each code
  split into two 4-bit halves: exact, and faster on CPU than the int8 kernel.
- `Int8Linear`: int8 codes with one scale per output row (`torch._weight_int8pack_mm`).

The kernels are fast only for 16-bit activations (float32 takes a slow fallback: 100x slower at
decode sizes), so the engine quantizes only with a bf16/fp16 model dtype. The scales are kept in
that dtype, so they are the GGUF's float16 scales rounded to it; the codes are exact.

They are weight readers for a few rows: the int4 kernel dequantizes its weight again for every 4
rows. From `DENSE_MIN_ROWS` rows on (prompts), a layer multiplies with its weight dequantized
once into the activation dtype instead, a dense GEMM (oneDNN: AMX or AVX512-BF16), kept after
the first such call (SmolLM2: +270 MB, 0.8 s once on 2 cores). SmolLM2's 120 projections at
1,000 rows: 1,877 ms int4, 267 ms dense bf16. The dense weight is the dequantized weight rounded
to the dtype; compiled steps (decode) never take it."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minisgl.ext.cpu import native, policy
from minisgl.ext.cpu.gguf_quant import KScales
from minisgl.layers.base import Module

INT4_OFFSET = 8  # torch's int4 kernels subtract 8 from every code
INT4_ROWS = 16  # the CPU packing wants a multiple of 16 output rows
# rows from which a layer takes a dense GEMM of its dequantized weight: faster from about 16
# rows, but a short chat turn (the shell's first question) stays under it and so costs no build
DENSE_MIN_ROWS = 64


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    return out_features % INT4_ROWS == 0 and in_features % group_size == 0 and group_size % 2 == 0


@functools.cache
def int4_layout(out_features: int, in_features: int) -> torch.Tensor:
    """Where each nibble of torch's CPU int4 packing of [out, in] codes comes from: the flat
    index into the codes of every `nibbles(packed)` entry. The layout is the packer's own
    (blocked for its kernel), so it is read off the packer: packing each base-16 digit of
    the indices gives that digit of each nibble's source."""
    count = out_features * in_features
    index = torch.arange(count, dtype=torch.int64)
    source = torch.zeros(count, dtype=torch.int64)
    for shift in range(0, max(count - 1, 1).bit_length(), 4):
        digits = ((index >> shift) & 15).to(torch.int32).view(out_features, in_features)
        packed = torch._convert_weight_to_int4pack_for_cpu(digits, 1)
        source |= nibbles(packed).to(torch.int64) << shift
    return source


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The packed bytes' nibbles, flat: each byte's low one, then its high one."""
    return torch.stack([packed & 15, packed >> 4], -1).flatten()


class QuantizedLinear(Module):
    """A linear layer without bias whose weight is stored quantized (the family's interface)."""

    in_features: int
    out_features: int
    dense: torch.Tensor | None = None  # the dequantized weight, once a call had many rows

    def dequantize(self) -> torch.Tensor:
        """The float weight [out, in] the layer computes with (tests, fallbacks)."""
        raise NotImplementedError

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> QuantizedLinear:
        """The layer back from its `state_dict()` (the packed-layer cache)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features))
        return out.reshape(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] in the scales' dtype -> [T, out] (the linear layers call it directly):
        the quantized kernel, or from `DENSE_MIN_ROWS` rows a dense GEMM."""
        # compiling first: a comparison of a dynamic row count would constrain the export
        if torch.compiler.is_compiling() or x.shape[0] < DENSE_MIN_ROWS:
            return self.kernel_matmul(x)
        # without bf16 instructions (minisgl's AVX2 kernel) a 16-bit GEMM is ~10x float32's
        dtype = x.dtype if policy.cpu_bf16_flag() is not None else torch.float32
        if self.dense is None or self.dense.dtype != dtype:
            self.dense = self.dequantize().to(dtype)  # not a buffer: never saved
        return F.linear(x.to(dtype), self.dense).to(x.dtype)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`matmul` by the quantized kernel."""
        raise NotImplementedError


class Int4Linear(QuantizedLinear):
    """packed [out, in / 2] (torch's CPU int4 layout), scale_zeros [in / group, out, 2] (the
    activation dtype); `pack` builds them from codes in 0..15 and per-group scales and zeros."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.group_size = self.in_features // scale_zeros.shape[0]
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int4Linear:
        """codes [out, in] in 0..15, scales and zeros [out, in / group]."""
        out_features, in_features = codes.shape
        group = in_features // scales.shape[1]
        if not int4_fits(out_features, in_features, group) or scales.shape != zeros.shape:
            raise ValueError(f"int4 scales {tuple(scales.shape)} do not fit codes {codes.shape}")
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        return cls(packed, torch.stack([scales.t(), zeros.t()], -1).contiguous())

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> QuantizedLinear:
        return cls(state["packed"], state["scale_zeros"])

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scale_zeros
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, sz)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes back out of the packed layout (int32 [out, packed in])."""
        out_features, in_features = self.packed.shape[0], self.packed.shape[1] * 2
        flat = torch.empty(out_features * in_features, dtype=torch.uint8)
        flat[int4_layout(out_features, in_features)] = nibbles(self.packed)
        return flat.view(out_features, in_features).to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        scales, zeros = (self.scale_zeros[..., i].t().float() for i in (0, 1))
        codes = self.codes().float().unflatten(1, (-1, self.group_size)) - INT4_OFFSET
        w = codes * scales.unsqueeze(-1) + zeros.unsqueeze(-1)
        return w.flatten(1)


class Int8SplitLinear(Int4Linear):
    """Grouped 8-bit codes, w = d c + m with c in -128..127 (GGUF Q8_0: m = 0), on the int4
    kernel: c + 128 = 16 h + l with h, l in 0..15, so x W^T = [x, x] [W_h | W_l]^T where
    W_h = 16 d (h - 8) (zero 0) and W_l = d (l - 8) + (8 d + m), the file's codes and
    per-group scales kept. Measured on a 2-core AVX512 CPU, 49152 x 576 (SmolLM2's LM head):
    1.8 ms against 2.9 for `torch._weight_int8pack_mm`'s per-row codes; 30 distinct 3072 x 576
    layers: 3.3 against 5.5 ms."""

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor) -> None:
        super().__init__(packed, scale_zeros)
        self.in_features //= 2  # the packed rows hold both halves

    @classmethod
    def split(
        cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype
    ) -> Int8SplitLinear:
        """codes [out, in] in -128..127; float32 scales and mins [out, in / group], each
        rounded once to `dtype` (16 d exactly; 8 d + m as one value, as `Int4Linear` does)."""
        biased = codes.to(torch.int32) + 128
        halves = torch.cat([biased // 16, biased % 16], 1)
        zeros = torch.cat([torch.zeros_like(mins), mins + INT4_OFFSET * scales], 1)
        scale_halves = torch.cat([16 * scales, scales], 1)
        both = Int4Linear.pack(halves, scale_halves.to(dtype), zeros.to(dtype))
        return cls(both.packed, both.scale_zeros)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return super().kernel_matmul(torch.cat([x, x], -1))

    def dequantize(self) -> torch.Tensor:
        halves = super().dequantize()
        return halves[:, : self.in_features] + halves[:, self.in_features :]


class Int8Linear(QuantizedLinear):
    """codes int8 [out, in], one scale per output row (the activation dtype)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8Linear:
        """Symmetric per-row quantization: scale = max |w| / 127 (a zero row gets scale 1)."""
        w = weight.float()
        scales = w.abs().amax(1).clamp_min(1e-12) / 127
        codes = torch.round(w / scales[:, None]).clamp(-127, 127)
        return cls(codes, scales.to(dtype))

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> QuantizedLinear:
        return cls(state["codes"], state["scales"])

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]


SUPER_BLOCKS = 8  # blocks of 32 a K-quant scale head covers (256 weights)


def k_scale_bytes(bits: int, has_min: bool) -> int:
    """A tile's scale bytes per 256 weights in qdot.cpp's K-quant layout (its super_bytes)."""
    return 32 * (1 + has_min) + SUPER_BLOCKS * 16 * ((2 if bits == 6 else 1) + has_min)


class VnniLinear(QuantizedLinear):
    """GGUF blocks of 32 on minisgl's kernel (`native.py`: minisgl::qdot_mm): four-bit codes
    q, w = d q + mn (Q4_1: mn = its min) or, without mn, d (q - 8) (Q4_0); eight-bit u, w = d (u
    - 128) + mn (Q8_0, or parts of mixed kinds); or six-bit u with a d for each 16 weights, w =
    d_h (u - 32) + mn (Q6_K, and the parts merged with it); d and mn the file's float16 values.
    codes uint8 [out / 16, in / 32, 64 bytes a bit] and scales float16 [out / 16, in / 32, rows,
    16] in qdot.cpp's layout: d (six-bit: of weights 0-15, of 16-31), then mn, a row left out
    where every mn is 0, or -8 d at four bits (Q6_K, Q8_0, Q4_0: half a bit a weight less to
    read); `tile` builds them. K-quants (Q4_K, Q5_K, Q6_K) keep the file's factors instead
    (`tile_k`): scales uint8 [out / 16, in / 256, bytes], per 256 weights float16 rows D (and
    M), then each block's int8 rows sc (two at six bits; and m): d = D sc, mn = M m."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.out_features = codes.shape[0] * native.TILE_ROWS
        self.in_features = codes.shape[1] * native.BLOCK
        self.bits = codes.shape[2] // native.BYTES_PER_BIT
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    @property
    def halves(self) -> bool:
        """A d for each 16 weights (the six-bit layout)."""
        return self.bits == 6

    @property
    def k_layout(self) -> bool:
        """The K-quants' scales (`tile_k`)."""
        return self.scales.dtype == torch.uint8

    @property
    def has_min(self) -> bool:
        """The scales' mn row (without it mn is 0, and four-bit codes are offset by 8)."""
        if self.k_layout:
            return self.scales.shape[2] == k_scale_bytes(self.bits, True)
        return self.scales.shape[2] > 1 + self.halves

    @property
    def offset(self) -> int:
        """What the weights take off the codes: w = d (code - offset) (+ mn)."""
        return {4: 0 if self.has_min else 8, 6: 32, 8: 128}[self.bits]

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """The kernel runs here and its tiles fit the shape."""
        tiles = out_features % native.TILE_ROWS == 0 and in_features % native.BLOCK == 0
        return tiles and native.native_kernel() is not None

    @classmethod
    def tile(
        cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
    ) -> VnniLinear:
        """codes [out, in] (0..15 at 4 bits, 0..63 at 6, 0..255 at 8), scales d [out, in / 32]
        or at 6 bits [out, in / 16], mins mn [out, in / 32] or None (float16 values) -> the
        layer."""
        tiles, blocks = codes.shape[0] // native.TILE_ROWS, codes.shape[1] // native.BLOCK
        assert (scales.shape[1] == 2 * blocks) == (bits == 6), "a d per 16 weights at 6 bits"
        ds = list(scales.view(scales.shape[0], blocks, 2).unbind(-1)) if bits == 6 else [scales]
        rows = torch.stack(ds if mins is None else [*ds, mins]).to(torch.float16)  # [r, out, g]
        rows = rows.view(-1, tiles, native.TILE_ROWS, blocks).permute(1, 3, 0, 2).contiguous()
        return cls(cls.tile_codes(codes, bits), rows)

    @classmethod
    def tile_k(cls, codes: torch.Tensor, k: KScales, bits: int) -> VnniLinear:
        """codes as `tile`'s, a K-quant's factors (sc per 16 weights at 6 bits, else per 32;
        m_scale and m, or neither) -> the layer with qdot.cpp's K-quant scales."""
        tiles, rows16 = codes.shape[0] // native.TILE_ROWS, native.TILE_ROWS
        supers = codes.shape[1] // (SUPER_BLOCKS * native.BLOCK)

        def head(values: torch.Tensor) -> torch.Tensor:  # [out, supers] -> [t, s, 32] bytes
            rows = values.to(torch.float16).view(tiles, rows16, supers).permute(0, 2, 1)
            return rows.contiguous().view(torch.uint8)

        def per_block(values: torch.Tensor) -> torch.Tensor:  # [out, n] -> [t, s, 8, rows, 16]
            rows = values.to(torch.int8).view(tiles, rows16, supers, SUPER_BLOCKS, -1)
            return rows.permute(0, 2, 3, 4, 1)

        heads, subs = [head(k.d)], [per_block(k.sc)]
        if k.m is not None and k.m_scale is not None:
            heads, subs = [*heads, head(k.m_scale)], [*subs, per_block(k.m)]
        sub = torch.cat(subs, 3).reshape(tiles, supers, -1).view(torch.uint8)
        return cls(cls.tile_codes(codes, bits), torch.cat([*heads, sub], 2).contiguous())

    @staticmethod
    def tile_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
        """codes [out, in] in qdot.cpp's layout of `bits` [out / 16, in / 32, 64 bytes a bit]."""
        tiles, blocks = codes.shape[0] // native.TILE_ROWS, codes.shape[1] // native.BLOCK
        q = codes.to(torch.uint8).view(tiles, native.TILE_ROWS, blocks, 8, 4)  # [t, j, g, c, b]
        if bits == 8:  # -> [t, g, c, j, b]: k = 32g + 4c + b
            tiled = q.permute(0, 2, 3, 1, 4).reshape(tiles, blocks, -1)
        else:  # nibbles [t, g, c, j, b]: k = 32g + 8c + 4 (high) + b; at 6 bits the top pairs
            low = q[..., 0::2, :] & 15 | (q[..., 1::2, :] & 15) << 4
            parts = [low.permute(0, 2, 3, 1, 4).reshape(tiles, blocks, -1)]
            if bits == 6:  # bits 2s of [t, g, e, j, b]: those of chunk 4e + s
                top = (q >> 4).view(tiles, native.TILE_ROWS, blocks, 2, 4, 4)
                shifted = top << torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1)
                pairs = shifted.sum(-2, dtype=torch.uint8)  # the bits do not overlap: an or
                parts.append(pairs.permute(0, 2, 3, 1, 4).reshape(tiles, blocks, -1))
            tiled = torch.cat(parts, -1)
        return tiled.contiguous()

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> QuantizedLinear:
        return cls(state["codes"], state["scales"])

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.minisgl.qdot_mm(x, self.codes, self.scales)

    def unpacked_codes(self) -> torch.Tensor:
        """The codes [out, in] back out of the layout (int32: 0..15, 0..63 or 0..255)."""
        tiles, blocks = self.codes.shape[:2]

        def chunks(part: torch.Tensor) -> torch.Tensor:  # [t, g, c, j, b] -> [t, j, g, c, b]
            return part.reshape(tiles, blocks, -1, native.TILE_ROWS, 4).permute(0, 3, 1, 2, 4)

        if self.bits == 8:
            q = chunks(self.codes)
        else:  # [t, j, g, c, half, b] -> chunks 2c + half
            nibbles = chunks(self.codes[..., :256])
            q = torch.stack([nibbles & 15, nibbles >> 4], -2).flatten(3, 4)
        if self.bits == 6:  # chunk 4e + s: bits 2s of top pair chunk e
            top = chunks(self.codes[..., 256:]).unsqueeze(-2)
            shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1)
            q = q | (((top >> shifts) & 3) << 4).flatten(3, 4)
        return q.reshape(self.out_features, self.in_features).to(torch.int32)

    def block_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d [out, in / 32, or in / 16 at six bits], mn [out, in / 32]) float32: the scales the
        kernel computes with (the K-quants': d = D sc and mn = M m, exact)."""
        groups, out = 1 + self.halves, self.out_features
        if not self.k_layout:
            rows = [
                self.scales[:, :, i].permute(0, 2, 1).reshape(out, -1).float()
                for i in range(self.scales.shape[2])
            ]
            mn = rows[-1] if self.has_min else torch.zeros_like(rows[0])
            return torch.stack(rows[:groups], -1).flatten(1), mn
        tiles, supers = self.scales.shape[:2]
        split = 32 * (1 + self.has_min)
        head = self.scales[..., :split].contiguous().view(torch.float16).float()  # [t, s, 16 r]
        sub = self.scales[..., split:].contiguous().view(torch.int8).float()
        sub = sub.view(tiles, supers, SUPER_BLOCKS, groups + self.has_min, native.TILE_ROWS)
        d = head[:, :, None, None, :16] * sub[:, :, :, :groups]  # [t, s, 8, groups, 16]
        d = d.permute(0, 4, 1, 2, 3).reshape(out, -1)
        if not self.has_min:
            return d, torch.zeros(out, d.shape[1] // groups)
        mn = head[:, :, None, 16:] * sub[:, :, :, groups]  # [t, s, 8, 16]
        return d, mn.permute(0, 3, 1, 2).reshape(out, -1)

    def dequantize(self) -> torch.Tensor:
        d, mn = self.block_scales()  # [out, in / 32 or in / 16], [out, in / 32]
        q = self.unpacked_codes().float().unflatten(1, (d.shape[1], -1)) - self.offset
        mn = mn.repeat_interleave(d.shape[1] // mn.shape[1], 1)  # for each of d's groups
        return (q * d.unsqueeze(-1) + mn.unsqueeze(-1)).flatten(1)
