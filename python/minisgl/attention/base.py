from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeVar

import torch

from minisgl.core import Batch, get_global_ctx
from minisgl.kernel import DecodeRope

M = TypeVar("M", bound="AttnMetadata")


class AttnMetadata:
    """Base of each backend's per-batch metadata, which its `prepare` puts in
    `batch.attn_metadata` and its `forward` reads back through `of`."""

    @classmethod
    def of(cls: type[M], batch: Batch) -> M:
        md = batch.attn_metadata
        assert isinstance(md, cls), f"{cls.__name__} expected, the batch holds {type(md).__name__}"
        return md


class BaseAttnBackend(ABC):
    """Paged attention over the context's KV pool. `prepare` runs once per batch and stores its
    metadata in `batch.attn_metadata`. Per layer, the attention layer first writes the new
    tokens' K/V into the pool at `batch.out_loc` (`store_kv`, or the fused RoPE + store kernel,
    which writes the same slots), then `forward` attends q to the pool, new tokens included:
    it only reads the pool.

    CUDA graphs (decode only): `init_cuda_graph(max_bs)` once, then per captured batch size
    `prepare_for_capture(batch)` (outside the capture) before capturing the forward, and
    `prepare_for_replay(batch)` before each replay. Both put the metadata in buffers that live
    as long as the backend, so a replay reads the new batch; the forward launches nothing whose
    shape depends on KV lengths and never syncs with the host. The engine pads a batch to a
    captured size itself (dummy requests: cached_len 0, extend_len 1)."""

    name: str

    @abstractmethod
    def prepare(self, batch: Batch) -> None: ...

    def store_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> None:
        """Write the new tokens' k, v [num_tokens, num_kv_heads, head_dim] into the pool at
        `batch.out_loc` (cast to the pool's dtype). Every backend reads the pool's layout."""
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
        """Whether `forward_rope` serves this batch: RoPE and the K/V store inside the
        attention kernel, instead of the rotary kernel before it."""
        return False

    def forward_rope(
        self, q: torch.Tensor, rope: DecodeRope, layer_id: int, scale: float, batch: Batch
    ) -> torch.Tensor:
        """`forward` for q before RoPE; it also writes rope.k (rotated) and rope.v to the pool."""
        raise NotImplementedError(f"the {self.name} attention backend does not apply RoPE")

    def init_cuda_graph(self, max_bs: int) -> None:
        """Allocate the buffers for decode graphs of up to max_bs requests."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def prepare_for_capture(self, batch: Batch) -> None:
        """Like prepare() for a decode batch, with the metadata in the graph buffers."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def prepare_for_replay(self, batch: Batch) -> None:
        """Refill the graph buffers for a decode batch of a captured size."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")
