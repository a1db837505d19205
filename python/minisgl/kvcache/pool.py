"""MHAKVCache: the K and V pool for every layer, allocated once as a single tensor."""

from __future__ import annotations

import torch


class MHAKVCache:
    """buffer[0 = K | 1 = V, layer, page, offset in page, kv_head, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (2, num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: stale NaNs in never-written slots could leak through masked kernels.
        self.buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        # each layer's [slots, kv_heads, head_dim] views (a token's flat slot: page * page_size
        # + offset), made once: every layer reads and writes its pool each step (indexing +
        # view per call cost ~5 us on a CPU decode)
        flat = self.buffer.view(2, num_layers, -1, num_kv_heads, head_dim)
        self._k_flat, self._v_flat = list(flat[0].unbind(0)), list(flat[1].unbind(0))

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def k_flat(self, layer: int) -> torch.Tensor:
        return self._k_flat[layer]

    def v_flat(self, layer: int) -> torch.Tensor:
        return self._v_flat[layer]

    def store(self, layer: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, kv_heads, head_dim] at the flat slots out_loc [T]."""
        # The attention layer's path without the fused ops: with them (CUDA) its RoPE kernel
        # stores K and V itself (`rotary_store_kv`), or the triton decode kernel does.
        store_kv_torch(self.k_flat(layer), self.v_flat(layer), out_loc, k, v)

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


def store_kv_torch(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Reference KV store: pools [slots, kv_heads, head_dim], rows out_loc <- k, v; the CPU path."""
    loc = out_loc if out_loc.dtype == torch.int64 else out_loc.to(torch.int64)
    if k.dtype != k_pool.dtype:
        k, v = k.to(k_pool.dtype), v.to(v_pool.dtype)
    # index_put_, not index_copy_: the latter has no fp8 kernel on CPU
    k_pool.index_put_((loc,), k)
    v_pool.index_put_((loc,), v)
