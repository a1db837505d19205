from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.core import Batch


class BaseAttnBackend(ABC):
    """Paged attention over the context's KV pool. `prepare` runs once per batch and stores its
    metadata in `batch.attn_metadata`; `forward` runs once per layer and also writes the new
    tokens' k/v into the pool at `batch.out_loc`."""

    @abstractmethod
    def prepare(self, batch: Batch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        layer_id: int,
        scale: float,
        batch: Batch,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]

    # CUDA-graph decode (see engine/graph.py). Backends without it keep the default: the engine
    # then runs every batch eagerly.
    def init_cuda_graph(self, max_bs: int) -> None:
        raise NotImplementedError

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError
