"""Paged KV cache: the tensor pool, the page allocator and the prefix caches."""

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.manager import KVCacheManager
from minisgl.kvcache.pool import MHAKVCache
from minisgl.kvcache.prefix_cache import CacheHandle, NaivePrefixCache, RadixPrefixCache

__all__ = [
    "CacheHandle",
    "KVCacheManager",
    "MHAKVCache",
    "NaivePrefixCache",
    "PageAllocator",
    "RadixPrefixCache",
]
