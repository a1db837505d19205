"""The KV cache's invariants as the tests check them: every page is in exactly one place (the
allocator's free list, the prefix cache, or one admitted request), and the radix tree's
bookkeeping (lock counts, LRU stamps, page counts) agrees with its nodes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from minisgl.kvcache.manager import KVCacheManager
from minisgl.kvcache.prefix_cache import RadixPrefixCache


def check_integrity(cache: RadixPrefixCache) -> None:
    """AssertionError if the tree's bookkeeping is inconsistent."""
    counts = [0, 0]  # evictable, locked pages
    stack = [cache._root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and key == cache._key(child.tokens, 0) and child.pages
            assert len(child.tokens) == len(child.pages) * cache.page_size and child.ref >= 0
            if node is not cache._root:  # every handle locked below a node passes through it
                assert child.ref <= node.ref and child.last_access <= node.last_access
            counts[child.ref > 0] += len(child.pages)
            stack.append(child)
    assert counts == [cache.evictable_pages, cache.locked_pages]


def check_invariants(manager: KVCacheManager, owned_by_requests: Sequence[int] = ()) -> None:
    """AssertionError unless each page is in one place: free, cached or a request's."""
    cache = manager.prefix_cache
    check_integrity(cache)
    cached = cache.owned_pages()
    counts = Counter(manager.allocator._free + cached + list(owned_by_requests))
    twice = [page for page, n in counts.items() if n > 1]
    assert not twice, f"pages in two places (free, cached, a request's): {twice[:10]}"
    lost = set(range(manager.num_pages)).symmetric_difference(counts)
    assert not lost, f"pages lost or out of range: {sorted(lost)[:10]}"
    assert len(cached) == cache.num_pages


def check_no_leak(scheduler: Any) -> None:
    """Every page is free, the prefix cache's, or exactly one admitted request's."""
    check_invariants(scheduler.cache, scheduler.planner.owned_pages())
