"""The per-process context that layers reach during a forward (set by the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.core import Batch
    from minisgl.kvcache.pool import MHAKVCache


@dataclass
class Context:
    """Per-process global state the model's layers read during a forward."""

    page_size: int
    page_table: torch.Tensor  # [max_running_requests + 1 (the dummy row), pages per req] int32
    kv_cache: MHAKVCache
    attn_backend: BaseAttnBackend
    batch: Batch | None = None
    page_table_version: int = 0  # bumped on every page-table write (backends cache plans by it)

    def kv_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The flat KV-pool slot of each (page-table row, position) pair: the one formula."""
        pages = self.page_table[rows, positions // self.page_size].long()
        return pages * self.page_size + positions % self.page_size


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    if _GLOBAL_CTX is None:
        raise RuntimeError("minisgl context is not initialised: create an Engine first")
    return _GLOBAL_CTX
