"""FlashInfer attention: paged prefill (causal; FA3 on Hopper, else FA2) and decode, planned once
a batch in `prepare` for every layer, on the pool's `k_cache` / `v_cache` (its NHD layout)."""

# Decode CUDA graphs: one graph-mode wrapper per captured batch size over shared buffers,
# re-planned before each replay unless the batch holds the same pages as the last plan (single
# stream: 15 steps of 16), when only the last pages' fill changes.

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.context import get_global_ctx
from minisgl.core import AttnMetadata, Batch

WORKSPACE_BYTES = 256 << 20  # split-KV partial results; shared by every wrapper
INT_WORKSPACE_BYTES = 8 << 20  # plan metadata; shared too (each plan precedes its runs)


@dataclass
class FiAttnMetadata(AttnMetadata):
    wrapper: Any  # the planned flashinfer wrapper this batch runs


def page_indices(
    page_table: torch.Tensor, rows: torch.Tensor, indptr: torch.Tensor, total: int
) -> torch.Tensor:
    """The first indptr[i+1] - indptr[i] entries of page_table[rows[i]] for every i, back to
    back (flashinfer's flat page list), on the table's device without a host sync."""
    req = torch.repeat_interleave(indptr.diff(), output_size=total)
    col = torch.arange(total, device=indptr.device, dtype=indptr.dtype) - indptr[req]
    return page_table[rows[req], col]


class FlashInferAttnBackend(BaseAttnBackend):
    name = "fi"

    def __init__(
        self,
        device: torch.device,
        num_qo_heads: int | None,
        kv_dtype: torch.dtype | None = None,  # the KV pool's (q's too: flashinfer runs one)
        sliding_window: int | None = None,
    ) -> None:
        if kv_dtype is not None and kv_dtype.itemsize != 2:
            raise ValueError(
                f"the fi (flashinfer) attention backend needs a 16-bit KV cache, got {kv_dtype} "
                "(it does not support float32 or fp8): use a 16-bit --dtype, or --attn triton "
                "(fp8 too) or torch"
            )
        if num_qo_heads is None:
            raise ValueError("the fi attention backend needs num_qo_heads")
        if device.type != "cuda":
            raise ValueError(f"the fi (flashinfer) attention backend needs CUDA, got {device}")
        try:
            import flashinfer
        except Exception as e:  # not installed, or built for another CUDA / torch
            raise ValueError(
                f"the fi attention backend needs flashinfer ({e}); "
                "install flashinfer-python or use --attn triton"
            ) from e

        self.fi = flashinfer
        self.num_qo_heads = num_qo_heads
        # flashinfer's window_left counts the keys left of the query: W - 1 for a W-token window
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # auto: FA3 on Hopper (1.6x the Triton extend at 8k after 8k on an H200; its JIT build
        # takes ~80 s on 16 cores, once per machine), else FA2
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="auto"
        )
        self.prefill_wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        self.decode_wrapper: Any = None  # built at the first decode (needs kv heads)
        self.graph_wrappers: dict[int, Any] = {}  # batch size -> graph-mode decode wrapper
        self.graph_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.plan_done: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> after its last plan
        # what the plan now in the shared int workspace was made for (graph decode only)
        self.planned_key: tuple | None = None

    def prepare(self, batch: Batch) -> None:
        if batch.is_decode and self.decode_wrapper is None:
            self.decode_wrapper = self._new_decode_wrapper()
        self._plan(self.decode_wrapper if batch.is_decode else self.prefill_wrapper, batch)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: Batch) -> torch.Tensor:
        # `scale` is head_dim ** -0.5, as planned
        kv_cache = get_global_ctx().kv_cache
        q = q if q.stride(-1) == 1 else q.contiguous()
        kv = (kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id))
        return FiAttnMetadata.of(batch).wrapper.run(q, kv)

    def init_cuda_graph(self, max_bs: int) -> None:
        page_table = get_global_ctx().page_table
        device = page_table.device
        self.graph_wrappers, self.planned_key = {}, None  # wrappers hold the old buffers
        self.graph_bufs = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=device),  # kv page indptr
            torch.zeros(max_bs * page_table.shape[1], dtype=torch.int32, device=device),  # pages
            torch.zeros(max_bs, dtype=torch.int32, device=device),  # last page lengths
        )

    def prepare_for_capture(self, batch: Batch) -> None:
        assert self.graph_bufs is not None, "init_cuda_graph() first"
        bs, (indptr, pages, last) = batch.size, self.graph_bufs
        if bs not in self.graph_wrappers:
            self.graph_wrappers[bs] = self._new_decode_wrapper(
                use_cuda_graph=True, paged_kv_indptr_buffer=indptr[: bs + 1],
                paged_kv_indices_buffer=pages, paged_kv_last_page_len_buffer=last[:bs],
            )  # fmt: skip
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self._plan(self.graph_wrappers[batch.size], batch, graph=True)

    def _new_decode_wrapper(self, **graph_args: Any) -> Any:
        kv_heads = get_global_ctx().kv_cache.num_kv_heads
        # Tensor cores pay off once a kv head serves >= 4 query heads (sglang's rule; flashinfer
        # documents them as faster for large groups). Below that (Qwen3-0.6B: 2) the CUDA-core
        # kernel, which also reads each kv head once for its group, is as fast: decode is
        # memory-bound.
        wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_tensor_cores=self.num_qo_heads // kv_heads >= 4,
            backend="fa2",
            **graph_args,
        )
        wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        return wrapper

    def _plan(self, wrapper: Any, batch: Batch, graph: bool = False) -> None:
        """`wrapper.plan` of the batch's pages and the layers' shapes (`graph`: a graph's decode
        wrapper, whose last plan may still hold)."""
        ctx = get_global_ctx()
        kv = ctx.kv_cache
        batch.attn_metadata = FiAttnMetadata(wrapper)
        kv_lens = [r.cached_len + r.extend_len for r in batch.reqs]  # this forward's included
        num_pages = [-(-n // ctx.page_size) for n in kv_lens]
        last = [n - (p - 1) * ctx.page_size for n, p in zip(kv_lens, num_pages)]  # in last pages
        rows = [r.table_idx for r in batch.reqs]
        key = (id(wrapper), ctx.page_table_version, tuple(rows), tuple(num_pages))
        if graph and key == self.planned_key:
            # flashinfer's CUDA-core decode plan reads the page counts only (its indptr), and
            # the page table is unchanged since: the plan, the page list and the indptr in the
            # graph's buffers still hold; only the tokens in each last page moved on.
            assert self.graph_bufs is not None
            last_host = torch.tensor(last, dtype=torch.int32, pin_memory=True)
            self.graph_bufs[2][: batch.size].copy_(last_host, non_blocking=True)
            return
        args: tuple[Any, ...] = _kv_pages(rows, num_pages, last)
        shape: dict[str, Any] = {"head_dim": kv.head_dim}
        if not batch.is_decode:  # prefill: each request's new tokens attend causally
            qo_indptr = [0, *accumulate(r.extend_len for r in batch.reqs)]
            args = (torch.tensor(qo_indptr, dtype=torch.int32), *args)
            shape = {"head_dim_qk": kv.head_dim, "causal": True}
        # plan() stages metadata in the wrapper's pinned host buffer and copies it to the
        # device asynchronously: wait until the previous plan's copy ran before overwriting it
        # (the scheduler may prepare batch N+1 while batch N is still queued).
        if (done := self.plan_done.get(id(wrapper))) is not None:
            done.synchronize()
        wrapper.plan(
            *args, num_qo_heads=self.num_qo_heads, num_kv_heads=kv.num_kv_heads,
            page_size=ctx.page_size, window_left=self.window_left, sm_scale=kv.head_dim**-0.5,
            q_data_type=kv.dtype, kv_data_type=kv.dtype, **shape,
        )  # fmt: skip
        self.plan_done[id(wrapper)] = done = torch.cuda.Event()
        done.record()
        # this plan overwrote the shared int workspace: it holds for the next replay of the same
        # pages only where flashinfer's plan reads page counts alone (CUDA-core decode)
        self.planned_key = key if graph and not wrapper.use_tensor_cores else None


def _kv_pages(
    rows: list[int], num_pages: list[int], last: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv page indptr, flat page ids on the device, last page lengths) of page-table `rows`."""
    page_table = get_global_ctx().page_table
    indptr = [0, *accumulate(num_pages)]
    host = torch.tensor([indptr, [*rows, 0]], dtype=torch.int32, pin_memory=True)
    dev = host.to(page_table.device, non_blocking=True)  # pinned: no wait for the device
    pages = page_indices(page_table, dev[1, :-1], dev[0], indptr[-1])
    return host[0], pages, torch.tensor(last, dtype=torch.int32, pin_memory=True)
