from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.core import Batch
from minisgl.kernel import DecodeRope


class BaseAttnBackend(ABC):
    """Paged attention over the context's KV pool: `prepare` once per batch (its metadata in
    `batch.attn_metadata`), then per layer `forward` (q against the pool)."""

    # The new tokens' K/V are in the pool before `forward` (`MHAKVCache.store`, or the fused RoPE +
    # store kernel): it attends q to the pool, new tokens included.
    # CUDA graphs (decode only): `init_cuda_graph(max_bs)` once; per captured batch size
    # `prepare_for_capture(batch)` before capturing, `prepare_for_replay(batch)` before each
    # replay. Both fill buffers that live as long as the backend; the captured forward never
    # syncs with the host nor launches anything shaped by KV lengths. The engine pads a batch
    # to a captured size with dummy requests (cached_len 0, extend_len 1).

    name: str

    @abstractmethod
    def prepare(self, batch: Batch) -> None: ...

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
