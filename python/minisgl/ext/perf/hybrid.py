"""`--attn PREFILL,DECODE`: one backend for prefill batches, another for decode batches (the
`hybrid_attention` point; without this package such a pair is refused)."""

from __future__ import annotations

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch
from minisgl.kernel import DecodeRope


class HybridAttnBackend(BaseAttnBackend):
    def __init__(self, prefill: BaseAttnBackend, decode: BaseAttnBackend) -> None:
        self.prefill = prefill
        self.decode = decode
        self.name = f"{prefill.name},{decode.name}"

    def _for(self, batch: Batch) -> BaseAttnBackend:
        return self.decode if batch.is_decode else self.prefill

    def prepare(self, batch: Batch) -> None:
        self._for(batch).prepare(batch)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: Batch) -> torch.Tensor:
        return self._for(batch).forward(q, layer_id, scale, batch)

    def fuses_rope(self, batch: Batch) -> bool:
        return self._for(batch).fuses_rope(batch)

    def forward_rope(
        self, q: torch.Tensor, rope: DecodeRope, layer_id: int, scale: float, batch: Batch
    ) -> torch.Tensor:
        return self._for(batch).forward_rope(q, rope, layer_id, scale, batch)

    # CUDA graphs capture decode batches only
    def init_cuda_graph(self, max_bs: int) -> None:
        self.decode.init_cuda_graph(max_bs)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.decode.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self.decode.prepare_for_replay(batch)
