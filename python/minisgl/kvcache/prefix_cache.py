"""Prefix caches: map page-aligned token prefixes to the KV pages that hold them.

The radix tree stores, per node, a run of tokens (a multiple of page_size) and its pages.
A running request locks its matched path (ref count +1 on every node up to the root) so the
pages it reads can never be evicted; unlocked leaves are evicted oldest-access first.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class CacheHandle:
    """The result of a match: `length` matched tokens (a multiple of page_size).
    `node` is the cache's private cursor (the deepest matched node, or None)."""

    length: int
    node: Any = None


class BasePrefixCache:
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    def _check_aligned(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(
                f"{len(tokens)} tokens do not fill {len(pages)} pages of size {self.page_size}"
            )

    def match_prefix(self, tokens: Sequence[int]) -> tuple[CacheHandle, list[int]]:
        raise NotImplementedError

    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens a match would cover, changing nothing (no split, no LRU
        touch): what the lpm policy ranks waiting requests by."""
        return 0

    def lock(self, handle: CacheHandle) -> None:
        raise NotImplementedError

    def unlock(self, handle: CacheHandle) -> None:
        raise NotImplementedError

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        raise NotImplementedError

    def evict(self, num_pages: int) -> list[int]:
        raise NotImplementedError

    @property
    def evictable_pages(self) -> int:
        raise NotImplementedError

    @property
    def locked_pages(self) -> int:
        raise NotImplementedError

    @property
    def num_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    def reset(self) -> list[int]:
        raise NotImplementedError

    def owned_pages(self) -> list[int]:
        """Every page the cache owns (for invariant checks; O(cache size))."""
        raise NotImplementedError

    def check_integrity(self) -> None:
        """AssertionError if internal bookkeeping is inconsistent (tests only)."""


class NaivePrefixCache(BasePrefixCache):
    """Never shares anything: every request computes its own KV."""

    def match_prefix(self, tokens: Sequence[int]) -> tuple[CacheHandle, list[int]]:
        return CacheHandle(0), []

    def lock(self, handle: CacheHandle) -> None:
        assert handle.length == 0, "naive cache handles always match nothing"

    def unlock(self, handle: CacheHandle) -> None:
        assert handle.length == 0, "naive cache handles always match nothing"

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        self._check_aligned(tokens, pages)
        return list(pages)

    def evict(self, num_pages: int) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def locked_pages(self) -> int:
        return 0

    def reset(self) -> list[int]:
        return []

    def owned_pages(self) -> list[int]:
        return []


class _Node:
    __slots__ = ("parent", "children", "tokens", "pages", "ref", "last_access")

    def __init__(self, parent: _Node | None, tokens: list[int], pages: list[int]) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.tokens = tokens  # len(tokens) == len(pages) * page_size
        self.pages = pages
        self.ref = 0  # number of locked handles at or below this node
        self.last_access = 0


class RadixPrefixCache(BasePrefixCache):
    """Radix tree over page-aligned token chunks; edges keyed by the first page of tokens."""

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._root = _Node(None, [], [])
        self._root.ref = 1  # the root is never evicted nor counted
        self._clock = 0  # monotonic LRU stamp
        self._evictable = 0
        self._locked = 0

    # -- helpers ------------------------------------------------------------------------------

    def _key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _match_len(self, node: _Node, tokens: list[int], start: int) -> int:
        """Tokens of `node` matched by tokens[start:], rounded down to a page boundary."""
        n = min(len(node.tokens), len(tokens) - start)
        if tokens[start : start + n] == node.tokens[:n]:
            i = n
        else:
            i = 0
            while node.tokens[i] == tokens[start + i]:
                i += 1
        return i - i % self.page_size

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node` after `at` tokens (a page boundary, 0 < at < len); returns the new upper
        half. The upper half inherits the ref count: every handle locked at or below `node`
        now also passes through it, and handles keep pointing at the lower half."""
        p = at // self.page_size
        parent = node.parent
        assert parent is not None and 0 < at < len(node.tokens)
        upper = _Node(parent, node.tokens[:at], node.pages[:p])
        upper.ref = node.ref
        upper.last_access = node.last_access
        parent.children[self._key(upper.tokens, 0)] = upper
        node.tokens = node.tokens[at:]
        node.pages = node.pages[p:]
        node.parent = upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        while node is not self._root:
            node.last_access = self._clock
            node = node.parent  # type: ignore[assignment]

    # -- API ----------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> tuple[CacheHandle, list[int]]:
        tokens = list(tokens)
        node, pos, pages = self._root, 0, []
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            n = self._match_len(child, tokens, pos)
            if n < len(child.tokens):
                # Match ends inside `child`: split so the handle covers exactly what matched.
                child = self._split(child, n)
            pages += child.pages
            pos += n
            node = child
        self._touch(node)
        return CacheHandle(pos, node), pages

    def cached_length(self, tokens: Sequence[int]) -> int:
        tokens = list(tokens)
        node, pos = self._root, 0
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            n = self._match_len(child, tokens, pos)
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return pos

    def _path(self, handle: CacheHandle) -> list[_Node]:
        """Nodes from the handle's node up to (not including) the root."""
        if handle.length == 0:
            return []  # matched nothing: nothing to protect (and valid across reset())
        path, node = [], handle.node
        while node is not self._root:
            if node is None:
                raise ValueError("stale handle: its node was evicted or the cache was reset")
            path.append(node)
            node = node.parent
        return path

    def lock(self, handle: CacheHandle) -> None:
        for node in self._path(handle):
            if node.ref == 0:
                self._evictable -= len(node.pages)
                self._locked += len(node.pages)
            node.ref += 1

    def unlock(self, handle: CacheHandle) -> None:
        path = self._path(handle)
        # Refs never shrink towards the root, so checking the handle's own node suffices.
        if path and path[0].ref <= 0:
            raise ValueError("unlock of a handle that is not locked")
        for node in path:
            node.ref -= 1
            if node.ref == 0:
                self._evictable += len(node.pages)
                self._locked -= len(node.pages)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        self._check_aligned(tokens, pages)
        tokens, pages = list(tokens), list(pages)
        node, pos, rejected = self._root, 0, []
        while pos < len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                # New suffix: the cache takes ownership of the caller's pages.
                leaf = _Node(node, tokens[pos:], pages[pos // self.page_size :])
                node.children[self._key(tokens, pos)] = leaf
                self._evictable += len(leaf.pages)
                node = leaf
                break
            n = self._match_len(child, tokens, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            # Already cached: the cache keeps its pages; the caller's copies go back.
            first = pos // self.page_size
            for mine, theirs in zip(
                child.pages, pages[first : first + len(child.pages)], strict=True
            ):
                if mine != theirs:
                    rejected.append(theirs)
            pos += n
            node = child
        self._touch(node)
        return rejected

    def evict(self, num_pages: int) -> list[int]:
        if num_pages <= 0:
            return []
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.ref == 0:
                heap.append((node.last_access, id(node), node))
        heapq.heapify(heap)
        evicted: list[int] = []
        while heap and len(evicted) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._key(node.tokens, 0)]
            node.parent = None  # detach, so a stale handle fails loudly in lock()
            evicted += node.pages
            self._evictable -= len(node.pages)
            # The parent may have just become an unlocked leaf (the root has ref 1, never).
            if not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return evicted

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def locked_pages(self) -> int:
        return self._locked

    def reset(self) -> list[int]:
        if self._locked:
            raise RuntimeError(f"cannot reset the prefix cache: {self._locked} pages are locked")
        pages = self.owned_pages()
        # A fresh root: handles into the old tree can no longer reach this one.
        self._root = _Node(None, [], [])
        self._root.ref = 1
        self._evictable = 0
        return pages

    def owned_pages(self) -> list[int]:
        pages: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            pages += node.pages
            stack.extend(node.children.values())
        return pages

    def check_integrity(self) -> None:
        evictable = locked = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node is not self._root:
                assert node.parent is not None and node.pages
                assert len(node.tokens) == len(node.pages) * self.page_size
                assert node.parent.children.get(self._key(node.tokens, 0)) is node
                assert node.ref >= 0
                if node.parent is not self._root:
                    # Every handle locked below a node passes through it; stamps also propagate up.
                    assert node.ref <= node.parent.ref
                    assert node.last_access <= node.parent.last_access
                if node.ref:
                    locked += len(node.pages)
                else:
                    evictable += len(node.pages)
            for child in node.children.values():
                assert child.parent is node
                stack.append(child)
        assert (evictable, locked) == (self._evictable, self._locked)
