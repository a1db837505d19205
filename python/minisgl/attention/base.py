from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.core import Batch


class BaseAttnBackend(ABC):
    """Paged attention over the context's KV pool. `prepare` runs once per batch and stores its
    metadata in `batch.attn_metadata`; `forward` runs once per layer and also writes the new
    tokens' k/v into the pool at `batch.out_loc`, unless k = v = None: then the layer's own
    kernel already wrote them there (the fused RoPE + KV store on CUDA) and the backend reads
    the new tokens' K/V from the pool like the cached ones.

    CUDA graphs (decode only): `init_cuda_graph(max_bs)` once, then per captured batch size
    `prepare_for_capture(batch)` (outside the capture) before capturing the forward, and
    `prepare_for_replay(batch)` before each replay. Both put the metadata in buffers that live
    as long as the backend, so a replay reads the new batch; the forward launches nothing whose
    shape depends on KV lengths and never syncs with the host. The engine pads a batch to a
    captured size itself (dummy requests: cached_len 0, extend_len 1)."""

    name: str

    @abstractmethod
    def prepare(self, batch: Batch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: already stored
        v: torch.Tensor | None,
        layer_id: int,
        scale: float,
        batch: Batch,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]

    def init_cuda_graph(self, max_bs: int) -> None:
        """Allocate the buffers for decode graphs of up to max_bs requests."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def prepare_for_capture(self, batch: Batch) -> None:
        """Like prepare() for a decode batch, with the metadata in the graph buffers."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def prepare_for_replay(self, batch: Batch) -> None:
        """Refill the graph buffers for a decode batch of a captured size."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")
