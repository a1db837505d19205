"""The fi prefill of a backend pair (`hybrid.py`) with its prompts through FlashInfer's ragged
kernel: each layer gathers the prompts' keys and values from the pool's pages into one
contiguous buffer and attends there. On Hopper the ragged kernel (FA3) loads K and V with TMA,
which the paged one cannot do through a page table; with the gather counted it attended 12-22 %
faster on an H200 (`benchmark/kernels/fi_prefill_bench.py`: two 16,000-token prompts 3,192 us
against 3,594, 8,192 new after 8,192 cached 1,277 against 1,583, 32 of 1,024 tokens 379 against
458; the gather itself 46-106 us). A mixed step's leading decode rows read their long KV in
place: one-token rows on the pair's decode backend (Triton's split-KV kernel), rows of several
tokens (speculative verification) on the paged one, which also takes a batch whose prompts mostly
extend a cached prefix (a prefix-cache hit): gathering that prefix for a few new tokens costs
more than it saves. The plain equivalent is the core's paged fi prefill
(`attention/fi_backend.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.fi_backend import FlashInferAttnBackend
from minisgl.attention.triton_backend import TritonAttnMetadata
from minisgl.context import get_global_ctx
from minisgl.core import AttnMetadata, Batch, Req


@dataclass
class RaggedMetadata(AttnMetadata):
    decodes: Batch | None  # a mixed step's leading decode rows, prepared apart
    slots: torch.Tensor  # [keys] the prompts' pool slots, request after request


def key_positions(
    rows: torch.Tensor, kv_indptr: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page-table row, position) of every key: positions 0 .. kv_indptr[i+1] - kv_indptr[i] - 1
    of rows[i] for every i, back to back, on their device without a host sync."""
    req = torch.repeat_interleave(kv_indptr.diff(), output_size=total)
    pos = torch.arange(total, device=kv_indptr.device, dtype=kv_indptr.dtype) - kv_indptr[req]
    return rows[req], pos


def worth_gathering(prompts: list[Req]) -> bool:
    """Prompts whose new tokens are at least as many as their cached ones: the gather reads
    every key once, the attention each key once per query that sees it."""
    new, cached = sum(r.extend_len for r in prompts), sum(r.cached_len for r in prompts)
    return new > 0 and new >= cached


def graph_size(rows: int) -> int:
    """The decode CUDA graph `rows` requests pad to: engine/graph.py's sizes 1, 2, 4, then
    multiples of 8 (up to --cuda-graph-max-bs)."""
    return rows if rows <= 2 else 4 if rows <= 4 else -(-rows // 8) * 8


def graph_splits(rows: int, splits: int) -> int:
    """Triton's split count for `rows` decode rows as the graph they pad to has it: a kernel
    variant compiled at capture. The count for `rows` itself may be one no graph has, compiled
    mid-run (~1 s stalled a long-prompt run's first round on an H200)."""
    from minisgl.kernel import triton_attention

    padded = graph_size(rows)
    if padded == rows:
        return splits
    heads = get_global_ctx().kv_cache.num_kv_heads
    sms = triton_attention.num_sms(get_global_ctx().page_table.device)
    return triton_attention.decode_splits(padded, heads, sms)


class RaggedPrefill(BaseAttnBackend):
    def __init__(self, paged: FlashInferAttnBackend, decode: BaseAttnBackend) -> None:
        self.paged, self.decode, self.name = paged, decode, paged.name
        # its own plan buffer (the paged plan of a mixed step's decodes stays in the shared one);
        # the float workspace is scratch within one run, and the runs follow each other
        self.int_workspace = torch.zeros_like(paged.int_workspace)
        self.wrapper = paged.fi.BatchPrefillWithRaggedKVCacheWrapper(
            paged.workspace, "NHD", backend="auto"
        )
        self.wrapper.reset_workspace_buffer(paged.workspace, self.int_workspace)
        self.plan_done: torch.cuda.Event | None = None

    def prepare(self, batch: Batch) -> None:
        d = batch.num_decodes
        if self.paged.window_left >= 0 or not worth_gathering(batch.reqs[d:]):
            return self.paged.prepare(batch)
        decodes = None
        if d:
            one_token = all(r.extend_len == 1 for r in batch.reqs[:d])
            decodes = Batch(batch.reqs[:d], "decode" if one_token else "prefill")
            self._rows_backend(decodes).prepare(decodes)
            if isinstance(md := decodes.attn_metadata, TritonAttnMetadata):
                md.num_splits = graph_splits(d, md.num_splits)
        batch.attn_metadata = RaggedMetadata(decodes, self._plan(batch.reqs[d:]))

    def _rows_backend(self, decodes: Batch) -> BaseAttnBackend:
        return self.decode if decodes.is_decode else self.paged

    def _plan(self, prompts: list[Req]) -> torch.Tensor:
        """The ragged wrapper planned for the prompts; their slots, request after request."""
        ctx = get_global_ctx()
        kv = ctx.kv_cache
        kv_lens = [r.cached_len + r.extend_len for r in prompts]
        qo_indptr = [0, *accumulate(r.extend_len for r in prompts)]
        kv_indptr = [0, *accumulate(kv_lens)]
        host = torch.tensor(
            [qo_indptr, kv_indptr, [r.table_idx for r in prompts] + [0]],
            dtype=torch.int32,
            pin_memory=True,
        )
        dev = host.to(ctx.page_table.device, non_blocking=True)
        slots = ctx.kv_slots(*key_positions(dev[2, :-1], dev[1], kv_indptr[-1]))
        if self.plan_done is not None:  # the last plan's copy from its pinned buffer ran
            self.plan_done.synchronize()
        self.wrapper.plan(
            host[0], host[1], num_qo_heads=self.paged.num_qo_heads, num_kv_heads=kv.num_kv_heads,
            head_dim_qk=kv.head_dim, causal=True, sm_scale=kv.head_dim**-0.5,
            q_data_type=kv.dtype, kv_data_type=kv.dtype,
        )  # fmt: skip
        self.plan_done = torch.cuda.Event()
        self.plan_done.record()
        return slots

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: Batch) -> torch.Tensor:
        md = batch.attn_metadata
        if not isinstance(md, RaggedMetadata):
            return self.paged.forward(q, layer_id, scale, batch)
        kv_cache = get_global_ctx().kv_cache
        q = q if q.is_contiguous() else q.contiguous()
        out = torch.empty_like(q)
        n = 0 if md.decodes is None else md.decodes.num_tokens
        if md.decodes is not None:
            out[:n] = self._rows_backend(md.decodes).forward(q[:n], layer_id, scale, md.decodes)
        k = kv_cache.k_flat(layer_id).index_select(0, md.slots)
        v = kv_cache.v_flat(layer_id).index_select(0, md.slots)
        self.wrapper.run(q[n:], k, v, out=out[n:])
        return out


def ragged_prefill(prefill: BaseAttnBackend, decode: BaseAttnBackend) -> BaseAttnBackend:
    """A pair's prefill backend: fi's through the ragged kernel, any other as it is."""
    if isinstance(prefill, FlashInferAttnBackend):
        return RaggedPrefill(prefill, decode)
    return prefill
