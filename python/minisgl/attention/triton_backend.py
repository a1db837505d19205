"""Paged attention with `minisgl.kernel.triton_attention`: split-KV decode (CUDA-graph safe) and
causal extend (prefill), both reading KV through the page table."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from minisgl import env
from minisgl.attention.base import BaseAttnBackend
from minisgl.context import get_global_ctx
from minisgl.core import AttnMetadata, Batch
from minisgl.kernel import DecodeRope


@dataclass
class TritonAttnMetadata(AttnMetadata):
    max_extend_len: int  # prefill only: sizes the extend grid
    num_splits: int  # decode only: KV chunks per request, from the batch size alone
    # the rows of `_host_metadata`, on the device, in its order
    rows: torch.Tensor  # [B] int32 page-table row of each request
    cached_lens: torch.Tensor  # [B] int32 KV already in the pool before this forward
    extend_lens: torch.Tensor  # [B] int32 tokens this forward computes
    kv_lens: torch.Tensor  # [B] int32 cached + extend
    q_starts: torch.Tensor  # [B] int32 first token of each request in the flat q
    order: torch.Tensor  # [B] int32 the requests by KV length, longest first (decode's programs)


class TritonAttnBackend(BaseAttnBackend):
    name = "triton"

    def __init__(self, sliding_window: int | None = None) -> None:
        if sliding_window is not None:
            raise ValueError("the triton attention backend does not support sliding windows yet")
        try:
            from minisgl.kernel import triton_attention
        except ImportError as e:  # CPU-only installs have no triton
            raise ValueError(
                f"the triton attention backend needs the triton package ({e}); use --attn torch"
            ) from e

        self.kernels = triton_attention
        self.sm_count: int | None = None
        # [6, width] int32 metadata of the graphs whose batch pads to `width` columns: one
        # contiguous buffer each, so that refilling one is a bare copy (into a column slice of
        # a shared buffer it would be a copy kernel after the transfer)
        self.graph_bufs: dict[int, torch.Tensor] = {}

    def prepare(self, batch: Batch) -> None:
        host = _host_metadata(batch)
        dev = host.to(get_global_ctx().page_table.device, non_blocking=True)
        batch.attn_metadata = self._metadata(batch, dev[:, : batch.size])

    def init_cuda_graph(self, max_bs: int) -> None:
        self.graph_bufs = {}

    def prepare_for_capture(self, batch: Batch) -> None:
        device = get_global_ctx().page_table.device
        width = -(-batch.size // 4) * 4
        self.graph_bufs.setdefault(width, torch.zeros(6, width, dtype=torch.int32, device=device))
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        host = _host_metadata(batch)
        buf = self.graph_bufs[host.shape[1]]  # KeyError: a size that was not captured
        buf.copy_(host, non_blocking=True)
        batch.attn_metadata = self._metadata(batch, buf[:, : batch.size])

    def _metadata(self, batch: Batch, dev: torch.Tensor) -> TritonAttnMetadata:
        splits = 1
        if batch.is_decode:
            if self.sm_count is None:
                self.sm_count = self.kernels.num_sms(dev.device)
            kv_heads = get_global_ctx().kv_cache.num_kv_heads
            splits = self.kernels.decode_splits(batch.size, kv_heads, self.sm_count)
        max_extend = max(r.extend_len for r in batch.reqs)
        return TritonAttnMetadata(max_extend, splits, *dev)

    def fuses_rope(self, batch: Batch) -> bool:
        # One request only: rows of one request (verification, prompts as rows) would read the
        # K/V that other programs of the same launch store, and at 256 requests the rotary
        # kernel is measured faster (H100, session 24: -0.5 % bf16, -2 % fp8 tok/s fused; H200,
        # 12-01: fp8 -29.6 %)
        return batch.is_decode and batch.size == 1 and not env.disable_decode_rope()

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: Batch) -> torch.Tensor:
        return self.forward_rope(q, None, layer_id, scale, batch)

    def forward_rope(
        self, q: torch.Tensor, rope: DecodeRope | None, layer_id: int, scale: float, batch: Batch
    ) -> torch.Tensor:
        md, ctx = TritonAttnMetadata.of(batch), get_global_ctx()
        k_pool, v_pool = ctx.kv_cache.k_flat(layer_id), ctx.kv_cache.v_flat(layer_id)
        q = q if q.stride(-1) == 1 else q.contiguous()
        operands = (q, k_pool, v_pool, ctx.page_table, md.rows)
        if batch.is_decode:
            return self.kernels.decode_attention(
                *operands, md.kv_lens, md.num_splits, ctx.page_size, scale, rope=rope,
                order=md.order,
            )  # fmt: skip
        return self.kernels.extend_attention(
            *operands, md.q_starts, md.cached_lens, md.extend_lens, md.max_extend_len,
            ctx.page_size, scale,
        )  # fmt: skip


def _host_metadata(batch: Batch) -> torch.Tensor:
    """[6, B padded to a multiple of 4] int32: rows, cached, extend and KV lengths, q starts
    and the decode order (pinned: a copy from pageable memory waits for all queued work)."""
    reqs = batch.reqs
    cached = [r.cached_len for r in reqs]
    extend = [r.extend_len for r in reqs]
    kv_lens = [c + e for c, e in zip(cached, extend)]
    q_starts = [0, *accumulate(extend)][:-1]
    rows = [r.table_idx for r in reqs]
    # decode starts the longest requests' programs first: the last to start are short ones
    order = sorted(range(len(reqs)), key=kv_lens.__getitem__, reverse=True)
    # Rows padded to a multiple of 4 values, so each row's device copy starts 16-byte
    # aligned whatever the batch size: Triton compiles a kernel variant per pointer
    # alignment, and a new one compiling mid-run stalls it for a second or more.
    pad = [0] * (-len(reqs) % 4)
    return torch.tensor(
        [rows + pad, cached + pad, extend + pad, kv_lens + pad, q_starts + pad, order + pad],
        dtype=torch.int32,
        pin_memory=torch.cuda.is_available(),
    )
