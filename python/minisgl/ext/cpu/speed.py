"""The CPU speed paths of the torch path: RoPE from a precomputed (cos, cos) / (-sin, sin)
table, its rows looked up once a forward for every layer and q and k rotated as one view when k
follows q in the QKV output (bit for bit the core's path); attention in float32 for 16-bit models
(bit for bit); prompts without a cached prefix attended with SDPA's `is_causal` instead of a mask
(the flash kernel then skips the blocks above the diagonal: a 1,000-token prompt's attention 1.6x
faster, the same bits) or, where minisgl's CPU kernels run (`native.py`), with its own causal
kernel (`attention.cpp`: within float32 rounding of SDPA's, 1.5-3.6x faster again), which also
takes prompts with a cached prefix (else masked), and decode rows of a 16-bit pool (its decode
kernel: K and V read in place, not gathered); and a float32 model's RMSNorm and SiLU through
fused kernels (`fused.py`). `cpu_engine` (the `decoder_transform` point) installs them into each
built cpu engine before --enable-torch-compile compiles its decoder, and has the process keep
the memory its steps free (`heap.py`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from minisgl.attention.torch_backend import TorchAttnBackend, TorchAttnMetadata, gather_kv
from minisgl.context import get_global_ctx
from minisgl.core import Batch
from minisgl.ext.cpu import native, sampling
from minisgl.ext.cpu.fused import fused_ready, install_fused
from minisgl.ext.cpu.heap import keep_freed_memory
from minisgl.ext.cpu.torch_compile import compiled_decoder
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.rotary import RopeConfig, RotaryEmbedding
from minisgl.models.llama import LlamaForCausalLM


def cpu_engine(engine: Any) -> torch.nn.Module | None:
    """The `decoder_transform` point: on cpu the speed paths into the built engine
    (`engine.Engine`), then the compiled decoder under --enable-torch-compile, else None."""
    if engine.device.type == "cpu":
        keep_freed_memory()  # after the weights' load, whose temporaries may go back
        sampling.install()
        install_rotary(engine.model, engine.model_config.rope, engine.dtype)
        install_fused(engine.model, engine.dtype)
        if type(engine.attn_backend) is TorchAttnBackend:  # read by the Context built next
            engine.attn_backend = WideTorchAttnBackend(engine.attn_backend.sliding_window)
    return compiled_decoder(engine)


def install_rotary(model: LlamaForCausalLM, cfg: RopeConfig, dtype: torch.dtype) -> None:
    """One `TableRotary` for the model and every attention layer (the core shares one too)."""
    rotary = TableRotary(cfg, dtype)
    model.model.rotary = rotary
    for module in model.modules():
        if isinstance(module, AttentionLayer):
            module.rotary[0] = rotary


class TableRotary(RotaryEmbedding):
    """`RotaryEmbedding` with its rows from `rope_table`, looked up once a forward: every
    layer rotates at the same positions tensor (on cpu no CUDA graph refills one in place)."""

    def __init__(self, cfg: RopeConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg)
        # in the model's dtype, rounded once: a compiled graph looks rows up in each layer and
        # would skip a cast to 16 bits there (inductor), rotating by unrounded cos / sin
        self.tables = {dtype: rope_table(self.cos_sin).to(dtype)}
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype not in self.tables:  # q in another dtype than the model's (tests)
            self.tables[q.dtype] = rope_table(self.cos_sin).to(q.dtype)
            self._rows = None
        if torch.compiler.is_compiling():  # the compiled graph shares one lookup by itself
            rows = self.tables[q.dtype][positions].unsqueeze(2)
            return rotate(q, rows), rotate(k, rows)
        last = self._rows  # holds `positions`: a new forward's tensor is another object
        if last is None or last[0] is not positions or last[1].dtype != q.dtype:
            last = self._rows = (positions, self.tables[q.dtype][positions].unsqueeze(2))
        if (qk := adjacent(q, k)) is not None:  # QKV output: one rotation for both
            q_rot, k_rot = rotate(qk, last[1]).split_with_sizes([q.shape[1], k.shape[1]], 1)
            return q_rot, k_rot
        return rotate(q, last[1]), rotate(k, last[1])


def adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hk, D] view when k directly follows q in one storage (the QKV
    projection's output without q/k norm), else None."""
    d = q.shape[2]
    is_adjacent = (
        q.stride()[1:] == (d, 1) == k.stride()[1:]
        and (q.shape[0] <= 1 or q.stride(0) == k.stride(0))  # one row: its stride is arbitrary
        and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
        and k.storage_offset() == q.storage_offset() + q.shape[1] * d
    )
    if not is_adjacent:
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], d), q.stride())


def rope_table(cos_sin: torch.Tensor) -> torch.Tensor:
    """[max_position, 2, head_dim]: (cos, cos) and (-sin, sin) per position."""
    # a rotation is then x * cos + roll(x) * sin, four ops (transformers' rotate_half form)
    cos, sin = cos_sin.chunk(2, dim=-1)
    return torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)


def rotate(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by `rope_table` rows [T, 2, 1, D], bit for bit the two-halves form
    (float32 heads of a multiple of 32 through fused.cpp's one pass: the same roundings)."""
    if fused_ready(x) and x.stride()[1:] == (x.shape[2], 1) and x.shape[2] % 32 == 0:
        return torch.ops.minisgl.rotate(x, rows.squeeze(2))
    # first half x1 cos - x2 sin, second x2 cos + x1 sin; the halves swap in one flip
    swapped = x.view(*x.shape[:-1], 2, -1).flip(-2).view(x.shape)
    return x * rows[:, 0] + swapped * rows[:, 1]


@dataclass
class PromptMetadata(TorchAttnMetadata):
    """A batch of prompts whose keys all lie in the sliding window, packed for the native kernel
    (each prompt's new tokens, and its keys: a cached prefix, then the new tokens'). Without a
    cached prefix (`fresh`) the mask is dropped: queries and keys then start at one position,
    so SDPA's top-left `is_causal` masks exactly what it would (padded rows see more, and are
    dropped); with one, the core's masked path is the fallback."""

    fresh: bool
    q_starts: torch.Tensor  # int64 [B + 1]: each prompt's first new token in the batch, then T
    k_starts: torch.Tensor  # int64 [B + 1]: the same over the keys, then S
    k_slots: torch.Tensor  # [S] each key's KV slot


class WideTorchAttnBackend(TorchAttnBackend):
    """The torch backend with q, K and V widened to float32 (a no-op for float32 models): on
    CPU torch's 16-bit SDPA is 2-3x slower at decode sizes than widening first (widening is
    exact; the sums were float32 already). Prompts take `PromptMetadata`: the native kernel
    where it runs and the head size is a multiple of 64, else SDPA's `is_causal` when fresh.
    Decode rows of a 16-bit pool take the native decode kernel, which reads K and V in place
    (SmolLM2 after 1,024 tokens: 81.9 -> 130.6 tok/s on 2 cores, docs/benchmarks.md)."""

    def prepare(self, batch: Batch) -> None:
        super().prepare(batch)
        md, window = TorchAttnMetadata.of(batch), self.sliding_window
        kv_lens = [r.cached_len + r.extend_len for r in batch.reqs]
        if md.max_q_len == 1 or (window is not None and max(kv_lens) > window):
            return
        fresh = all(r.cached_len == 0 for r in batch.reqs)
        q_starts = torch.tensor([0, *itertools.accumulate(r.extend_len for r in batch.reqs)])
        k_starts = torch.tensor([0, *itertools.accumulate(kv_lens)])
        held = torch.arange(md.kv_slots.shape[1]) < torch.tensor(kv_lens)[:, None]
        mask = None if fresh else md.mask
        batch.attn_metadata = PromptMetadata(
            md.kv_slots, mask, md.q_index, md.max_q_len, fresh, q_starts, k_starts,
            md.kv_slots[held],
        )  # fmt: skip

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: Batch) -> torch.Tensor:
        md, wide = batch.attn_metadata, q.float()
        if isinstance(md, PromptMetadata) and native_fits(q):
            out = native_attention(wide, layer_id, scale, md)
        elif isinstance(md, PromptMetadata) and md.fresh:
            out = causal_attention(wide, layer_id, scale, md)
        elif isinstance(md, TorchAttnMetadata) and self.native_decode_fits(q, md):
            out = native_decode(wide, layer_id, scale, md)
        else:
            out = super().forward(wide, layer_id, scale, batch)
        return out.to(q.dtype)

    def native_decode_fits(self, q: torch.Tensor, md: TorchAttnMetadata) -> bool:
        """Decode rows of a 16-bit pool on attention.cpp (float32 pools keep SDPA's sums, which
        the float32 paths match transformers with; a window's mask is no prefix)."""
        sixteen_bit = get_global_ctx().kv_cache.dtype in (torch.bfloat16, torch.float16)
        head = q.shape[2] in (64, 128, 256) and native.float32_kernels()
        return md.max_q_len == 1 and sixteen_bit and self.sliding_window is None and head


def native_fits(q: torch.Tensor) -> bool:
    return q.shape[2] % 64 == 0 and native.float32_kernels()


def native_decode(
    q: torch.Tensor, layer_id: int, scale: float, md: TorchAttnMetadata
) -> torch.Tensor:
    """Decode rows through attention.cpp, each against its slots where the pools hold them (no
    gathered or widened copy): every slot, or the mask's prefix of them."""
    pools = get_global_ctx().kv_cache
    rows, length = md.kv_slots.shape
    if md.mask is None:
        lens = md.kv_slots.new_full((rows,), length)
    else:
        lens = md.mask.reshape(rows, length).sum(-1)
    k, v = pools.k_flat(layer_id), pools.v_flat(layer_id)
    return torch.ops.minisgl.decode_attention(q, k, v, md.kv_slots, lens, scale)


def native_attention(
    q: torch.Tensor, layer_id: int, scale: float, md: PromptMetadata
) -> torch.Tensor:
    """The prompts through attention.cpp, each new token against its prompt's keys up to it."""
    pools = get_global_ctx().kv_cache
    keys = pools.k_flat(layer_id).index_select(0, md.k_slots).to(q.dtype)
    values = pools.v_flat(layer_id).index_select(0, md.k_slots).to(q.dtype)
    return torch.ops.minisgl.causal_attention(q, keys, values, md.q_starts, md.k_starts, scale)


def causal_attention(
    q: torch.Tensor, layer_id: int, scale: float, md: PromptMetadata
) -> torch.Tensor:
    """`TorchAttnBackend.forward` of a fresh prompt batch, causal by `is_causal`."""
    pools = get_global_ctx().kv_cache
    slots, (bsz, length), (_, heads, dim) = md.kv_slots, md.kv_slots.shape, q.shape
    keys = gather_kv(pools.k_flat(layer_id), slots, q.dtype)
    values = gather_kv(pools.v_flat(layer_id), slots, q.dtype)
    if bsz == 1:  # one prompt: no padding to build or drop
        padded = q.view(1, length, heads, dim)
    else:
        padded = q.new_zeros(bsz * length, heads, dim)
        padded[md.q_index] = q
        padded = padded.view(bsz, length, heads, dim)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys, values, is_causal=True, scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2).reshape(bsz * length, heads, dim)
    return out if bsz == 1 else out[md.q_index]
