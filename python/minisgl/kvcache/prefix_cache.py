"""Prefix caches: page-aligned token prefixes -> the KV pages that hold them (a radix tree)."""

# Each node holds a run of tokens (a multiple of page_size) and its pages. A running request
# locks its matched path (ref count +1 on every node up to the root) so the pages it reads can
# never be evicted; unlocked leaves are evicted oldest-access first.

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class CacheHandle:
    """A match: `length` matched tokens (a multiple of page_size), its deepest `node`."""

    length: int
    node: Any = None


class _Node:
    __slots__ = ("parent", "children", "tokens", "pages", "ref", "last_access")

    def __init__(self, parent: _Node | None, tokens: list[int], pages: list[int]) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by their first page of tokens
        self.tokens = tokens  # len(tokens) == len(pages) * page_size
        self.pages = pages
        self.ref = 0  # number of locked handles at or below this node
        self.last_access = 0


class RadixPrefixCache:
    """Radix tree over page-aligned token runs; `evictable_pages` + `locked_pages` = its pages."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._clock = 0  # monotonic LRU stamp
        self.locked_pages = 0
        self._root = _Node(None, [], [])
        self.reset()

    @property
    def num_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    def _key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _match_len(self, node: _Node, tokens: list[int], start: int) -> int:
        """Tokens of `node` matched by tokens[start:], rounded down to a page boundary."""
        n = min(len(node.tokens), len(tokens) - start)
        i = n
        if tokens[start : start + n] != node.tokens[:n]:
            i = 0
            while node.tokens[i] == tokens[start + i]:
                i += 1
        return i - i % self.page_size

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node` after `at` tokens (a page boundary inside it) -> the new upper half."""
        # The upper half inherits the ref count: every handle locked at or below `node` passes
        # through it, and handles keep pointing at the lower half.
        parent, p = node.parent, at // self.page_size
        assert parent is not None and 0 < at < len(node.tokens)
        upper = _Node(parent, node.tokens[:at], node.pages[:p])
        upper.ref, upper.last_access = node.ref, node.last_access
        parent.children[self._key(upper.tokens, 0)] = upper
        node.tokens, node.pages, node.parent = node.tokens[at:], node.pages[p:], upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def _walk(self, tokens: list[int], split: bool) -> tuple[_Node, int, list[int]]:
        """(deepest node, length, pages) of the longest cached page-aligned prefix of `tokens`."""
        # A match that ends inside a node splits it there (`split`), so that a handle covers
        # exactly what matched; without `split` the walk stops there.
        node, pos = self._root, 0
        pages: list[int] = []
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            n = self._match_len(child, tokens, pos)
            if n < len(child.tokens):
                if not split:
                    return node, pos + n, pages
                child = self._split(child, n)
            pages += child.pages
            node, pos = child, pos + n
        return node, pos, pages

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        while node is not self._root:
            node.last_access = self._clock
            node = node.parent  # type: ignore[assignment]

    def match_prefix(self, tokens: Sequence[int]) -> tuple[CacheHandle, list[int]]:
        """The longest cached prefix of `tokens`: its handle (unlocked) and pages."""
        node, length, pages = self._walk(list(tokens), split=True)
        self._touch(node)
        return CacheHandle(length, node), pages

    def cached_length(self, tokens: Sequence[int]) -> int:
        """The length a match would have, changing nothing (the lpm policy's ranking)."""
        return self._walk(list(tokens), split=False)[1]

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
                self.evictable_pages -= len(node.pages)
                self.locked_pages += len(node.pages)
            node.ref += 1

    def unlock(self, handle: CacheHandle) -> None:
        path = self._path(handle)
        # Refs never shrink towards the root, so checking the handle's own node suffices.
        if path and path[0].ref <= 0:
            raise ValueError("unlock of a handle that is not locked")
        for node in path:
            node.ref -= 1
            if node.ref == 0:
                self.evictable_pages += len(node.pages)
                self.locked_pages -= len(node.pages)

    def _check_aligned(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(
                f"{len(tokens)} tokens do not fill {len(pages)} pages of size {self.page_size}"
            )

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache `tokens` held in `pages` -> the pages it already had copies of (to free)."""
        self._check_aligned(tokens, pages)
        tokens = list(tokens)
        node, pos, cached = self._walk(tokens, split=True)
        if pos < len(tokens):  # a new suffix: the cache takes the caller's pages
            leaf = _Node(node, tokens[pos:], list(pages[pos // self.page_size :]))
            node.children[self._key(tokens, pos)] = leaf
            self.evictable_pages += len(leaf.pages)
            node = leaf
        self._touch(node)
        return [theirs for mine, theirs in zip(cached, pages) if mine != theirs]

    def evict(self, num_pages: int) -> list[int]:
        """At least `num_pages` pages (fewer if fewer are unlocked), least recently used first."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        evicted: list[int] = []
        while heap and len(evicted) < num_pages:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            assert parent is not None
            del parent.children[self._key(node.tokens, 0)]
            node.parent = None  # detached: a stale handle fails loudly in lock()
            evicted += node.pages
            self.evictable_pages -= len(node.pages)
            if not parent.children and parent.ref == 0:  # a new unlocked leaf (never the root)
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return evicted

    def reset(self) -> list[int]:
        """Empty the cache (nothing may be locked) -> the pages it held."""
        if self.locked_pages:
            raise RuntimeError(
                f"cannot reset the prefix cache: {self.locked_pages} pages are locked"
            )
        pages = self.owned_pages()
        self._root = _Node(None, [], [])  # handles into the old tree cannot reach this one
        self._root.ref = 1  # the root is never evicted nor counted
        self.evictable_pages = 0
        return pages

    def owned_pages(self) -> list[int]:
        """Every page in the tree (O(cache size))."""
        return [page for node in self._nodes() for page in node.pages]

    def _nodes(self) -> list[_Node]:
        """Every node of the tree, the root first."""
        nodes = [self._root]
        for node in nodes:  # the list grows as it is read: each node's children join its end
            nodes.extend(node.children.values())
        return nodes


class NaivePrefixCache(RadixPrefixCache):
    """Shares nothing (its tree stays empty): every request computes its own KV."""

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        self._check_aligned(tokens, pages)
        return list(pages)
