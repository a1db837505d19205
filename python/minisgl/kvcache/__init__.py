"""Paged KV cache: the tensor pool, the page allocator and the prefix caches."""
