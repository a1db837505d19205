"""KVCacheManager: the page allocator and the prefix cache, kept consistent with each other."""

# Every page is in exactly one place: the allocator's free list, the prefix cache, or a running
# request (pages the request allocated itself and has not released yet).

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.prefix_cache import CacheHandle, NaivePrefixCache, RadixPrefixCache


class KVCacheManager:
    def __init__(
        self, num_pages: int, page_size: int, cache: Literal["radix", "naive"] = "radix"
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.allocator = PageAllocator(num_pages)
        # (SchedulerConfig refuses another --cache with its choices; here: a KeyError)
        kinds = {"radix": RadixPrefixCache, "naive": NaivePrefixCache}
        self.prefix_cache = kinds[cache](page_size)

    def match_and_lock(self, tokens: Sequence[int]) -> tuple[CacheHandle, list[int]]:
        handle, pages = self.prefix_cache.match_prefix(tokens)
        self.prefix_cache.lock(handle)
        return handle, pages

    def available_pages(self) -> int:
        return self.allocator.num_free + self.prefix_cache.evictable_pages

    def allocate(self, n: int) -> list[int] | None:
        """n pages, evicting cached ones if needed; None (nothing evicted) when too few."""
        if n > self.available_pages():
            return None
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.prefix_cache.evict(short))
        return self.allocator.alloc(n)

    def _num_full_pages(
        self, tokens: Sequence[int], pages: Sequence[int], handle: CacheHandle
    ) -> int:
        """Full pages of a request's computed `tokens`, after checking they fit its pages."""
        size = self.page_size
        if len(tokens) > len(pages) * size:
            raise ValueError(f"{len(tokens)} tokens cannot live in {len(pages)} pages of {size}")
        if handle.length > len(tokens) // size * size:
            # The matched pages belong to the cache; they must not be freed or replaced.
            raise ValueError(f"handle matched {handle.length} tokens but only {len(tokens)} given")
        return len(tokens) // size

    def release(self, tokens: Sequence[int], pages: Sequence[int], handle: CacheHandle) -> None:
        """A request ends: its full pages of computed `tokens` to the cache, the rest freed."""
        num_full = self._num_full_pages(tokens, pages, handle)
        rejected = self.prefix_cache.insert(tokens[: num_full * self.page_size], pages[:num_full])
        self.allocator.free(rejected + list(pages[num_full:]))
        self.prefix_cache.unlock(handle)

    def cache_prefix(
        self, tokens: Sequence[int], pages: Sequence[int], handle: CacheHandle
    ) -> tuple[CacheHandle, list[int]]:
        """Share a running request's computed KV (`tokens`) before it ends: its full pages into
        the cache, locked instead of `handle` -> (new handle, the request's new page list)."""
        # Pages the cache already had replace the request's copies (freed): the caller points
        # the request's page table at the returned pages.
        num_full = self._num_full_pages(tokens, pages, handle)
        full = tokens[: num_full * self.page_size]
        if len(full) == handle.length:
            return handle, list(pages)  # no new full page
        self.prefix_cache.insert(full, pages[:num_full])
        new_handle, cached = self.match_and_lock(full)
        self.prefix_cache.unlock(handle)
        # A cache that keeps nothing (naive) matches nothing: the request keeps all its pages.
        self.allocator.free([mine for mine, theirs in zip(pages, cached) if mine != theirs])
        return new_handle, cached + list(pages[len(cached) :])

    def reset_cache(self) -> None:
        self.allocator.free(self.prefix_cache.reset())
