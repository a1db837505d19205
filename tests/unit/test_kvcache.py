"""Tests for minisgl.kvcache: allocator, prefix caches, manager and the tensor pool."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.manager import KVCacheManager
from minisgl.kvcache.pool import MHAKVCache
from minisgl.kvcache.prefix_cache import CacheHandle, NaivePrefixCache, RadixPrefixCache
from support.invariants import check_integrity, check_invariants

# ---------------------------------------------------------------------------------------------
# PageAllocator


def test_allocator_alloc_free() -> None:
    a = PageAllocator(8)
    assert a.num_pages == 8 and a.num_free == 8
    assert a.alloc(0) == []
    p = a.alloc(3)
    assert p is not None and len(set(p)) == 3 and a.num_free == 5
    q = a.alloc(5)
    assert q is not None and not set(p) & set(q) and a.num_free == 0
    assert a.alloc(1) is None
    a.free(p)
    assert a.num_free == 3
    assert sorted(a.alloc(3) or []) == sorted(p)


def test_allocator_too_many_changes_nothing() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    assert a.alloc(3) is None
    assert a.num_free == 2


def test_allocator_errors_leave_state_intact() -> None:
    a = PageAllocator(4)
    p = a.alloc(2)
    assert p is not None
    free_before = sorted(a._free)
    with pytest.raises(ValueError):
        a.free([p[0], free_before[0]])  # second one is already free
    with pytest.raises(ValueError):
        a.free([p[0], 4])  # out of range
    with pytest.raises(ValueError):
        a.free([p[0], -1])
    with pytest.raises(ValueError):
        a.free([p[0], p[0]])  # duplicate in one call
    assert sorted(a._free) == free_before
    a.free(p)
    with pytest.raises(ValueError):
        a.free([p[1]])  # double free
    assert a.num_free == 4


# ---------------------------------------------------------------------------------------------
# RadixPrefixCache


def test_radix_match_after_insert_page_size_1() -> None:
    c = RadixPrefixCache(1)
    assert c.insert([1, 2, 3], [10, 11, 12]) == []
    h, pages = c.match_prefix([1, 2, 3, 4])
    assert (h.length, pages) == (3, [10, 11, 12])
    h, pages = c.match_prefix([1, 2, 5])
    assert (h.length, pages) == (2, [10, 11])
    h, pages = c.match_prefix([7])
    assert (h.length, pages) == (0, [])
    assert c.num_pages == 3 and c.evictable_pages == 3 and c.locked_pages == 0
    check_integrity(c)


def test_radix_page_alignment_page_size_4() -> None:
    c = RadixPrefixCache(4)
    toks = list(range(8))
    assert c.insert(toks, [5, 6]) == []
    assert c.match_prefix(toks)[0].length == 8
    assert c.match_prefix(toks[:7])[0].length == 4  # partial second page does not count
    assert c.match_prefix(toks[:3])[0].length == 0
    assert c.match_prefix([0, 1, 2, 3, 4, 99, 6, 7])[1] == [5]  # diverges inside page 2
    assert c.match_prefix([0, 1, 99, 3, 4, 5, 6, 7])[1] == []  # diverges inside page 1
    with pytest.raises(ValueError):
        c.insert(toks[:6], [1, 2])
    with pytest.raises(ValueError):
        c.insert(toks[:4], [1, 2])
    check_integrity(c)


def test_radix_split_on_insert_and_match() -> None:
    c = RadixPrefixCache(2)
    c.insert([1, 1, 2, 2, 3, 3], [0, 1, 2])
    # Diverges after the first page: splits [0,1,2] into [0] -> {[1,2], [9]}.
    assert c.insert([1, 1, 4, 4], [7, 9]) == [7]
    assert c.match_prefix([1, 1, 4, 4])[1] == [0, 9]
    assert c.match_prefix([1, 1, 2, 2, 3, 3])[1] == [0, 1, 2]
    # A match ending mid-node splits it so the handle covers exactly the match.
    h, pages = c.match_prefix([1, 1, 2, 2, 5, 5])
    assert pages == [0, 1]
    c.lock(h)
    assert c.locked_pages == 2 and c.evictable_pages == 2
    assert sorted(c.evict(100)) == [2, 9]
    c.unlock(h)
    assert sorted(c.evict(100)) == [0, 1]
    assert c.num_pages == 0
    check_integrity(c)


def test_radix_insert_returns_duplicates() -> None:
    c = RadixPrefixCache(1)
    assert c.insert([1, 2], [10, 11]) == []
    assert c.insert([1, 2], [10, 11]) == []  # same pages: nothing to give back
    assert c.insert([1, 2, 3], [20, 21, 22]) == [20, 21]  # 22 is kept for the new suffix
    assert c.insert([1, 2, 3], [10, 31, 22]) == [31]
    assert c.match_prefix([1, 2, 3])[1] == [10, 11, 22]
    assert sorted(c.owned_pages()) == [10, 11, 22]


def test_radix_lock_prevents_eviction() -> None:
    c = RadixPrefixCache(1)
    c.insert([1, 2, 3], [0, 1, 2])
    h, _ = c.match_prefix([1, 2, 3])
    c.lock(h)
    c.lock(h)  # two requests sharing the same prefix
    assert c.evict(10) == [] and c.locked_pages == 3 and c.evictable_pages == 0
    c.unlock(h)
    assert c.evict(10) == []
    c.unlock(h)
    assert sorted(c.evict(10)) == [0, 1, 2]
    with pytest.raises(ValueError):
        c.unlock(h)  # its node is gone


def test_radix_unlock_below_zero_raises() -> None:
    c = RadixPrefixCache(1)
    c.insert([1], [0])
    h, _ = c.match_prefix([1])
    with pytest.raises(ValueError):
        c.unlock(h)
    check_integrity(c)


def test_radix_split_above_locked_node_keeps_ref_counts() -> None:
    """The classic bug: a split above a locked node must give the new node the child's refs."""
    c = RadixPrefixCache(1)
    c.insert([1, 2, 3, 4], [0, 1, 2, 3])
    h, _ = c.match_prefix([1, 2, 3, 4])
    c.lock(h)
    c.insert([1, 2, 9], [10, 11, 12])  # splits the locked node into [1,2] -> [3,4]
    c.match_prefix([1, 5])  # another split, at [1] -> [2]
    check_integrity(c)
    assert c.locked_pages == 4 and c.evictable_pages == 1
    assert c.evict(100) == [12]
    c.unlock(h)
    check_integrity(c)
    assert c.locked_pages == 0 and c.evictable_pages == 4
    assert sorted(c.evict(100)) == [0, 1, 2, 3]


def test_radix_lru_eviction_order() -> None:
    c = RadixPrefixCache(1)
    c.insert([1, 1], [10, 11])
    c.insert([2, 2], [20, 21])
    c.insert([3, 3], [30, 31])
    c.match_prefix([1, 1])  # refresh the oldest
    assert sorted(c.evict(1)) == [20, 21]  # a whole leaf, may exceed the ask
    assert sorted(c.evict(2)) == [30, 31]
    assert sorted(c.evict(2)) == [10, 11]


def test_radix_eviction_cascades_to_parents() -> None:
    c = RadixPrefixCache(1)
    c.insert([1, 2], [0, 1])
    c.insert([1, 3], [0, 2])
    c.insert([4], [3])
    c.match_prefix([4])  # [4] is newest; the [1] subtree goes first, parent after children
    out = c.evict(3)
    assert sorted(out) == [0, 1, 2] and out[-1] == 0
    assert c.evict(1) == [3]


def test_radix_reset() -> None:
    c = RadixPrefixCache(2)
    c.insert([1, 2, 3, 4], [5, 6])
    h, _ = c.match_prefix([1, 2])
    c.lock(h)
    with pytest.raises(RuntimeError):
        c.reset()
    c.unlock(h)
    assert sorted(c.reset()) == [5, 6]
    assert c.num_pages == 0 and c.match_prefix([1, 2, 3, 4])[0].length == 0


def test_naive_cache() -> None:
    c = NaivePrefixCache(2)
    c.insert([1, 2], [3])
    h, pages = c.match_prefix([1, 2, 3, 4])
    assert (h.length, pages) == (0, [])
    c.lock(h)
    c.unlock(h)
    assert c.insert([1, 2, 3, 4], [7, 8]) == [7, 8]
    assert c.evict(10) == [] and c.reset() == []
    assert c.num_pages == c.evictable_pages == c.locked_pages == 0
    with pytest.raises(ValueError):
        c.insert([1], [7])


# ---------------------------------------------------------------------------------------------
# KVCacheManager


def test_manager_release_and_reuse() -> None:
    m = KVCacheManager(num_pages=8, page_size=2)
    toks = [1, 2, 3, 4, 5]  # 2 full pages + 1 partial
    h, cached = m.match_and_lock(toks)
    assert cached == []
    pages = m.allocate(3)
    assert pages is not None
    check_invariants(m, pages)
    m.release(toks, pages, h)
    check_invariants(m)
    assert m.prefix_cache.num_pages == 2 and m.allocator.num_free == 6
    h2, cached2 = m.match_and_lock([1, 2, 3, 4, 9, 9])
    assert cached2 == pages[:2] and h2.length == 4
    assert m.available_pages() == 6
    mine = m.allocate(1)
    assert mine is not None
    m.release([1, 2, 3, 4, 9, 9], cached2 + mine, h2)
    check_invariants(m)
    assert m.prefix_cache.num_pages == 3
    m.reset_cache()
    assert m.allocator.num_free == 8


def test_manager_allocate_evicts_and_fails_cleanly() -> None:
    m = KVCacheManager(num_pages=4, page_size=1)
    h, _ = m.match_and_lock([1, 2, 3])
    p = m.allocate(3)
    assert p is not None
    m.release([1, 2, 3], p, h)
    assert m.allocator.num_free == 1 and m.available_pages() == 4
    h, cached = m.match_and_lock([1, 2])
    assert len(cached) == 2 and m.available_pages() == 2
    assert m.allocate(3) is None
    assert m.prefix_cache.num_pages == 3  # nothing evicted by the failed call
    q = m.allocate(2)  # evicts the unlocked page [3]
    assert q is not None and m.prefix_cache.num_pages == 2
    check_invariants(m, q)
    m.release([1, 2], cached + q, h)  # tokens shorter than pages: spare pages are freed
    check_invariants(m)
    with pytest.raises(AssertionError):
        check_invariants(m, [0])  # a page claimed by a request while free or cached


def test_manager_release_rejects_bad_lengths() -> None:
    m = KVCacheManager(num_pages=4, page_size=2)
    h, _ = m.match_and_lock([1, 2])
    p = m.allocate(1)
    assert p is not None
    with pytest.raises(ValueError):
        m.release([1, 2, 3], p, h)


def test_manager_cache_prefix_shares_and_dedups() -> None:
    m = KVCacheManager(num_pages=8, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    ha, _ = m.match_and_lock(prompt)
    hb, _ = m.match_and_lock(prompt)  # both admitted before either is computed
    a, b = m.allocate(3), m.allocate(3)
    assert a is not None and b is not None
    ha, a2 = m.cache_prefix(prompt[:3], a, ha)  # first chunk: one full page
    assert ha.length == 2 and a2 == a
    ha, a2 = m.cache_prefix(prompt, a, ha)  # last chunk
    assert ha.length == 4 and a2 == a and m.prefix_cache.locked_pages == 2
    hc, c = m.match_and_lock(prompt)
    assert c == a[:2]  # a third request would share it now
    m.prefix_cache.unlock(hc)
    free = m.allocator.num_free
    hb, b2 = m.cache_prefix(prompt, b, hb)  # b computed the same prompt: its copies go back
    assert b2 == a[:2] + b[2:] and m.allocator.num_free == free + 2
    check_invariants(m, a[2:] + b[2:])
    # Release at finish with generated tokens past the shared part.
    m.release(prompt + [6], a, ha)
    m.release(prompt, b2, hb)
    check_invariants(m)
    assert m.prefix_cache.locked_pages == 0 and m.prefix_cache.num_pages == 3
    with pytest.raises(ValueError):
        m.cache_prefix([1], [0], CacheHandle(2))  # handle longer than the computed tokens


def test_manager_naive() -> None:
    m = KVCacheManager(num_pages=4, page_size=1, cache="naive")
    h, cached = m.match_and_lock([1, 2])
    p = m.allocate(2)
    assert cached == [] and p is not None
    h, p2 = m.cache_prefix([1, 2], p, h)  # shares nothing: the request keeps its pages
    assert h.length == 0 and p2 == p and m.allocator.num_free == 2
    m.release([1, 2], p, h)
    assert m.allocator.num_free == 4
    assert m.match_and_lock([1, 2])[1] == []
    with pytest.raises(KeyError):  # (SchedulerConfig's choices refuse it first: test_errors.py)
        KVCacheManager(4, 1, cache="lru")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# MHAKVCache


def test_mha_kv_cache_store_roundtrip() -> None:
    L, N, P, H, D = 3, 5, 4, 2, 8
    pool = MHAKVCache(L, N, P, H, D, torch.float32, torch.device("cpu"))
    assert pool.buffer.shape == (2, L, N, P, H, D)
    assert pool.k_cache(1).shape == (N, P, H, D) and pool.v_flat(2).shape == (N * P, H, D)
    assert pool.buffer.numel() * 4 == N * MHAKVCache.bytes_per_page(L, P, H, D, torch.float32)
    assert MHAKVCache.bytes_per_page(L, P, H, D, torch.bfloat16) == 2 * L * P * H * D * 2
    loc = torch.tensor([0, 5, 19, 7], dtype=torch.int32)
    k, v = torch.randn(4, H, D), torch.randn(4, H, D)
    pool.store(1, loc, k, v)
    torch.testing.assert_close(pool.k_flat(1)[loc.long()], k)
    torch.testing.assert_close(pool.v_flat(1)[loc.long()], v)
    # Views share storage with the buffer: slot 5 is page 1, offset 1.
    torch.testing.assert_close(pool.k_cache(1)[1, 1], k[1])
    torch.testing.assert_close(pool.v_cache(1)[4, 3], v[2])
    assert pool.k_flat(0).abs().sum() == 0 and pool.k_flat(2).abs().sum() == 0
    pool.store(1, loc.long(), v, k)  # int64 slots, overwrite
    torch.testing.assert_close(pool.k_flat(1)[loc.long()], v)


# ---------------------------------------------------------------------------------------------
# Property tests: the manager under simulated request traffic


@dataclass(eq=False)
class SimReq:
    tokens: list[int]
    pages: list[int]  # cached (matched) pages first, then the request's own
    handle: CacheHandle
    num_matched: int  # pages[:num_matched] belong to the cache

    @property
    def own(self) -> list[int]:
        return self.pages[self.num_matched :]


TOKENS = st.lists(st.integers(0, 3), max_size=20)


class ManagerMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.sampled_from([16, 32, 64]),
        cache=st.sampled_from(["radix", "radix", "naive"]),
    )
    def setup(self, page_size: int, num_pages: int, cache: str) -> None:
        self.m = KVCacheManager(num_pages, page_size, cache)  # type: ignore[arg-type]
        self.P = page_size
        self.radix = cache == "radix"
        self.live: list[SimReq] = []
        # What each page "holds": the tokens written into it (stands in for real KV data).
        self.content: dict[int, tuple[int, ...]] = {}

    def _write(self, r: SimReq, first_page: int) -> None:
        for j in range(first_page, len(r.pages)):
            self.content[r.pages[j]] = tuple(r.tokens[j * self.P : (j + 1) * self.P])

    def _pages_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.P)

    @rule(target=reqs, tokens=TOKENS, spare=st.integers(0, 2))
    def new_request(self, tokens: list[int], spare: int) -> SimReq | None:
        handle, matched = self.m.match_and_lock(tokens)
        assert handle.length == len(matched) * self.P <= len(tokens)
        for j, page in enumerate(matched):
            # The cache maps a prefix to the pages holding exactly those tokens.
            assert self.content[page] == tuple(tokens[j * self.P : (j + 1) * self.P])
        need = self._pages_needed(len(tokens)) - len(matched) + spare
        own = self.m.allocate(need)
        if own is None:
            assert self.m.available_pages() < need
            self.m.prefix_cache.unlock(handle)  # skip this request
            return None
        r = SimReq(list(tokens), matched + own, handle, len(matched))
        self._write(r, len(matched))
        self.live.append(r)
        return r

    @rule(r=reqs, more=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def decode(self, r: SimReq | None, more: list[int]) -> None:
        if r is None or r not in self.live:
            return
        first_dirty = len(r.tokens) // self.P  # the partial page gets more tokens
        r.tokens += more
        extra = self._pages_needed(len(r.tokens)) - len(r.pages)
        if extra > 0:
            new = self.m.allocate(extra)
            if new is None:
                del r.tokens[-len(more) :]  # "preempted": keep what it had
                return
            r.pages += new
        self._write(r, max(first_dirty, r.num_matched))

    @rule(r=reqs, data=st.data())
    def cache_prefix(self, r: SimReq | None, data: st.DataObject) -> None:
        """Share the computed part (e.g. the prompt chunks launched so far) while it runs."""
        if r is None or r not in self.live:
            return
        computed = r.tokens[: data.draw(st.integers(r.handle.length, len(r.tokens)))]
        old = r.pages
        handle, pages = self.m.cache_prefix(computed, old, r.handle)
        aligned = len(computed) // self.P * self.P
        assert handle.length == (aligned if self.radix else 0)
        assert len(pages) == len(old) and pages[aligned // self.P :] == old[aligned // self.P :]
        for j, page in enumerate(pages[: aligned // self.P]):
            # The cache's pages (maybe another request's) hold the same tokens as the duplicates.
            assert self.content[page] == tuple(computed[j * self.P : (j + 1) * self.P])
        assert set(old) - set(pages) <= set(self.m.allocator._free)
        if self.radix:
            assert self.m.prefix_cache.match_prefix(computed)[0].length == aligned
        r.handle, r.pages, r.num_matched = handle, pages, handle.length // self.P

    @rule(r=consumes(reqs), truncate=st.booleans(), data=st.data())
    def finish(self, r: SimReq | None, truncate: bool, data: st.DataObject) -> None:
        if r is None or r not in self.live:
            return
        self.live.remove(r)
        tokens = r.tokens
        if truncate:  # e.g. aborted mid-prefill: KV only exists for a prefix
            tokens = tokens[: data.draw(st.integers(r.handle.length, len(tokens)))]
        self.m.release(tokens, r.pages, r.handle)

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        evictable = self.m.prefix_cache.evictable_pages
        out = self.m.prefix_cache.evict(n)
        assert len(out) >= min(n, evictable)
        live_pages = {p for r in self.live for p in r.pages}
        assert not set(out) & live_pages, "evicted a page a live request uses"
        self.m.allocator.free(out)

    @precondition(lambda self: not self.live)
    @rule()
    def reset_cache(self) -> None:
        self.m.reset_cache()
        assert self.m.allocator.num_free == self.m.num_pages

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        own = [p for r in self.live for p in r.own]
        check_invariants(self.m, own)
        free = set(self.m.allocator._free)
        cached = set(self.m.prefix_cache.owned_pages())
        for r in self.live:
            matched = r.pages[: r.num_matched]
            assert not free & set(matched), "a page a live request matched went back to the pool"
            assert set(matched) <= cached
        total = self.m.allocator.num_free + self.m.prefix_cache.num_pages + len(own)
        assert total == self.m.num_pages
        assert self.m.prefix_cache.locked_pages <= sum(r.num_matched for r in self.live)

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for r in reversed(self.live):
            self.m.release(r.tokens, r.pages, r.handle)
        self.live.clear()
        check_invariants(self.m)
        assert self.m.prefix_cache.locked_pages == 0
        self.m.reset_cache()
        assert self.m.allocator.num_free == self.m.num_pages


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManagerMachine = ManagerMachine.TestCase


# ---------------------------------------------------------------------------------------------
# Property tests: RadixPrefixCache against a dict of page-aligned prefixes


class RadixModelMachine(RuleBasedStateMachine):
    """Model: every cached page-aligned prefix -> the page holding its last page of tokens."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.P = page_size
        self.c = RadixPrefixCache(page_size)
        self.model: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[CacheHandle, tuple[int, ...]]] = []
        self.next_page = 0

    def _aligned(self, tokens: list[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) - len(tokens) % self.P])

    def _expected_match(self, tokens: list[int]) -> list[int]:
        pages = []
        for j in range(len(tokens) // self.P):
            page = self.model.get(tuple(tokens[: (j + 1) * self.P]))
            if page is None:
                break
            pages.append(page)
        return pages

    @rule(tokens=TOKENS)
    def insert(self, tokens: list[int]) -> None:
        toks = self._aligned(tokens)
        n = len(toks) // self.P
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        expected_rejected = []
        for j, page in enumerate(pages):
            prefix = toks[: (j + 1) * self.P]
            if prefix in self.model:
                expected_rejected.append(page)
            else:
                self.model[prefix] = page
        assert self.c.insert(toks, pages) == expected_rejected

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens: list[int], lock: bool) -> None:
        handle, pages = self.c.match_prefix(tokens)
        assert pages == self._expected_match(tokens)
        assert handle.length == len(pages) * self.P
        if lock:
            self.c.lock(handle)
            self.locks.append((handle, tuple(tokens[: handle.length])))

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        handle, _ = self.locks.pop(i)
        self.c.unlock(handle)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        evictable = self.c.evictable_pages
        out = self.c.evict(n)
        assert len(out) >= min(n, evictable) and len(set(out)) == len(out)
        gone = {k for k, p in self.model.items() if p in set(out)}
        assert len(gone) == len(out)
        for k in gone:
            del self.model[k]
        for k in self.model:  # still prefix-closed: only leaves were removed
            assert all(k[: j * self.P] in self.model for j in range(1, len(k) // self.P))
        for _, toks in self.locks:
            assert not any(toks[: (j + 1) * self.P] in gone for j in range(len(toks) // self.P))

    @invariant()
    def counts(self) -> None:
        if not hasattr(self, "c"):
            return
        check_integrity(self.c)
        locked = {
            toks[: (j + 1) * self.P] for _, toks in self.locks for j in range(len(toks) // self.P)
        }
        assert self.c.locked_pages == len(locked)
        assert self.c.num_pages == len(self.model)
        assert sorted(self.c.owned_pages()) == sorted(self.model.values())


RadixModelMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestRadixModelMachine = RadixModelMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    seqs=st.lists(TOKENS, max_size=8),
    queries=st.lists(TOKENS, max_size=8),
)
def test_radix_match_is_longest_inserted_prefix(
    page_size: int, seqs: list[list[int]], queries: list[list[int]]
) -> None:
    c = RadixPrefixCache(page_size)
    prefixes: set[tuple[int, ...]] = set()
    page = 0
    for s in seqs:
        s = s[: len(s) - len(s) % page_size]
        c.insert(s, list(range(page, page + len(s) // page_size)))
        page += len(s) // page_size
        prefixes |= {tuple(s[:k]) for k in range(0, len(s) + 1, page_size)}
    for q in seqs + queries:
        want = max(k for k in range(0, len(q) + 1, page_size) if tuple(q[:k]) in prefixes | {()})
        assert c.match_prefix(q)[0].length == want
    check_integrity(c)
