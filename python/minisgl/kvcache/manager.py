"""KVCacheManager: the page allocator and the prefix cache, kept consistent with each other.

Every page is in exactly one place: the allocator's free list, the prefix cache, or a
running request (pages the request allocated itself and has not released yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.prefix_cache import (
    BasePrefixCache,
    CacheHandle,
    NaivePrefixCache,
    RadixPrefixCache,
)


class KVCacheManager:
    def __init__(
        self, num_pages: int, page_size: int, cache: Literal["radix", "naive"] = "radix"
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        if cache == "radix":
            self.prefix_cache: BasePrefixCache = RadixPrefixCache(page_size)
        elif cache == "naive":
            self.prefix_cache = NaivePrefixCache(page_size)
        else:
            raise ValueError(f"unknown prefix cache {cache!r} (expected 'radix' or 'naive')")

    def match_and_lock(self, tokens: Sequence[int]) -> tuple[CacheHandle, list[int]]:
        handle, pages = self.prefix_cache.match_prefix(tokens)
        self.prefix_cache.lock(handle)
        return handle, pages

    def cached_length(self, tokens: Sequence[int]) -> int:
        return self.prefix_cache.cached_length(tokens)

    def available_pages(self) -> int:
        return self.allocator.num_free + self.prefix_cache.evictable_pages

    def allocate(self, n: int) -> list[int] | None:
        if n > self.available_pages():
            return None  # checked first, so a failed call evicts nothing
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.prefix_cache.evict(short))
        pages = self.allocator.alloc(n)
        assert pages is not None, "evictable_pages overstated what evict() returned"
        return pages

    def _num_full_pages(
        self, tokens: Sequence[int], pages: Sequence[int], handle: CacheHandle
    ) -> int:
        """Full pages of a request's computed `tokens`, after checking they fit its pages."""
        size = self.page_size
        if len(tokens) > len(pages) * size:
            raise ValueError(f"{len(tokens)} tokens cannot live in {len(pages)} pages of {size}")
        num_full = len(tokens) // size
        if handle.length > num_full * size:
            # The matched pages belong to the cache; they must not be freed or replaced.
            raise ValueError(f"handle matched {handle.length} tokens but only {len(tokens)} given")
        return num_full

    def release(self, tokens: Sequence[int], pages: Sequence[int], handle: CacheHandle) -> None:
        size = self.page_size
        num_full = self._num_full_pages(tokens, pages, handle)
        rejected = self.prefix_cache.insert(tokens[: num_full * size], pages[:num_full])
        # Duplicates the cache already had, plus the partial last page and any spare pages.
        self.allocator.free(rejected + list(pages[num_full:]))
        self.prefix_cache.unlock(handle)

    def cache_prefix(
        self, tokens: Sequence[int], pages: Sequence[int], handle: CacheHandle
    ) -> tuple[CacheHandle, list[int]]:
        """Share a running request's computed KV (`tokens`, all computed) before it finishes:
        insert its page-aligned part, lock the new deeper node instead of `handle`, and return
        the new handle and the request's page list, where pages the cache already had replace
        the request's duplicates (those go back to the allocator). The caller must point the
        request's page table at the returned pages."""
        size = self.page_size
        num_full = self._num_full_pages(tokens, pages, handle)
        if num_full * size == handle.length:
            return handle, list(pages)  # no new full page
        self.prefix_cache.insert(tokens[: num_full * size], pages[:num_full])
        new_handle, cached = self.prefix_cache.match_prefix(tokens[: num_full * size])
        self.prefix_cache.lock(new_handle)
        self.prefix_cache.unlock(handle)
        # The radix cache now holds the whole prefix (`cached` covers num_full pages); a cache
        # that keeps nothing (naive) matches nothing and leaves the request all its pages.
        self.allocator.free([mine for mine, theirs in zip(pages, cached) if mine != theirs])
        return new_handle, cached + list(pages[len(cached) :])

    def reset_cache(self) -> None:
        assert self.prefix_cache.locked_pages == 0, "reset_cache with locked pages"
        self.allocator.free(self.prefix_cache.reset())

    def check_invariants(self, owned_by_requests: Sequence[int] = ()) -> None:
        self.prefix_cache.check_integrity()
        free = self.allocator.free_pages()
        cached = self.prefix_cache.owned_pages()
        live = list(owned_by_requests)
        for name, group in (("free", free), ("cached", cached), ("request", live)):
            assert len(set(group)) == len(group), f"duplicate pages among {name} pages"
        assert not set(free) & set(cached), f"free and cached: {set(free) & set(cached)}"
        assert not set(free) & set(live), f"free and request-owned: {set(free) & set(live)}"
        assert not set(cached) & set(live), f"cached and request-owned: {set(cached) & set(live)}"
        everything = set(free) | set(cached) | set(live)
        assert everything == set(range(self.num_pages)), (
            f"pages lost: {sorted(set(range(self.num_pages)) - everything)[:10]}, "
            f"out of range: {sorted(everything - set(range(self.num_pages)))[:10]}"
        )
        assert len(cached) == self.prefix_cache.num_pages
