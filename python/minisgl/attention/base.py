from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar

import torch

from minisgl.core import Batch, get_global_ctx
from minisgl.kernel import DecodeRope

M = TypeVar("M", bound="AttnMetadata")


class AttnMetadata:
    """A backend's per-batch metadata: `prepare` sets `batch.attn_metadata`, `of` reads it."""

    @classmethod
    def of(cls: type[M], batch: Batch) -> M:
        md = batch.attn_metadata
        assert isinstance(md, cls), f"{cls.__name__} expected, the batch holds {type(md).__name__}"
        return md


class BaseAttnBackend(ABC):
    """Paged attention over the context's KV pool: `prepare` once per batch (its metadata in
    `batch.attn_metadata`), then per layer `store_kv` and `forward` (q against the pool)."""

    # The new tokens' K/V are in the pool before `forward` (`store_kv`, or the fused RoPE +
    # store kernel): it attends q to the pool, new tokens included.
    # CUDA graphs (decode only): `init_cuda_graph(max_bs)` once; per captured batch size
    # `prepare_for_capture(batch)` before capturing, `prepare_for_replay(batch)` before each
    # replay. Both fill buffers that live as long as the backend; the captured forward never
    # syncs with the host nor launches anything shaped by KV lengths. The engine pads a batch
    # to a captured size with dummy requests (cached_len 0, extend_len 1).

    name: str

    @abstractmethod
    def prepare(self, batch: Batch) -> None: ...

    def store_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> None:
        """Write the new tokens' k, v [num_tokens, kv_heads, head_dim] into the pool."""
        assert batch.out_loc is not None
        get_global_ctx().kv_cache.store(layer_id, batch.out_loc, k, v)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        layer_id: int,
        scale: float,
        batch: Batch,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]

    def fuses_rope(self, batch: Batch) -> bool:
        """Whether `forward_rope` serves this batch (RoPE and the K/V store in the kernel)."""
        return False

    def forward_rope(
        self, q: torch.Tensor, rope: DecodeRope, layer_id: int, scale: float, batch: Batch
    ) -> torch.Tensor:
        """`forward` for q before RoPE; it also writes rope.k (rotated) and rope.v to the pool."""
        raise NotImplementedError(f"the {self.name} attention backend does not apply RoPE")

    def init_cuda_graph(self, max_bs: int) -> None:
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")
