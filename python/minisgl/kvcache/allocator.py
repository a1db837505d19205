"""Page allocator: hands out KV-pool page ids from a free stack."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PageAllocator:
    """A free stack of page ids plus a bool mask so frees can be checked in O(n)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Reversed so that the first allocations get the low page ids (easier to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = np.ones(num_pages, dtype=np.bool_)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n page ids, or None (nothing changed) when fewer are free."""
        if n > len(self._free):
            return None
        rest = len(self._free) - n
        pages = self._free[rest:][::-1]
        del self._free[rest:]
        self._is_free[pages] = False
        return pages

    def free(self, pages: Sequence[int]) -> None:
        if len(pages) == 0:
            return
        idx = np.asarray(pages, dtype=np.int64)
        # Validate everything before touching state, so a bad call leaves the allocator intact.
        if idx.min() < 0 or idx.max() >= self.num_pages:
            raise ValueError(f"page id out of range [0, {self.num_pages})")
        if self._is_free[idx].any():
            raise ValueError(f"double free of pages {idx[self._is_free[idx]].tolist()}")
        if len(np.unique(idx)) != len(idx):
            raise ValueError("duplicate page ids in one free() call")
        self._is_free[idx] = True
        self._free.extend(idx.tolist())
