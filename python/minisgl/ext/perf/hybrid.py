"""`--attn PREFILL,DECODE`: one backend for prefill batches, another for decode batches (the
`hybrid_attention` point; without this package such a pair is refused; a prefill fi runs its
prompts through the ragged kernel, `ragged.py`), and the pair that --attn auto makes on Hopper
(`auto_prefill`)."""

from __future__ import annotations

import torch

from minisgl import attention
from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch
from minisgl.ext.perf.ragged import ragged_prefill
from minisgl.kernel import DecodeRope


class HybridAttnBackend(BaseAttnBackend):
    def __init__(self, prefill: BaseAttnBackend, decode: BaseAttnBackend) -> None:
        self.prefill = ragged_prefill(prefill, decode)  # fi's: prompts through the ragged kernel
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


def hopper_prefill(device: torch.device, kv_dtype: torch.dtype | None) -> str:
    """--attn auto's prefill beside Triton's decode: fi on a Hopper GPU, whose FA3 kernel
    computes an extend 1.6x as fast as the Triton one (H200, 8k tokens after 8k), with a 16-bit
    KV cache (None: unknown, taken as 16-bit) and flashinfer; else triton (decode stays
    Triton's: faster than fi's there)."""
    sixteen_bit = kv_dtype is None or kv_dtype.itemsize == 2
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9
    return "fi" if sixteen_bit and hopper and attention.flashinfer_available() else "triton"
