"""Which --dp replica a request goes to, decided in the tokenizer worker once the prompt's token
ids are known, with no round trip to the replicas.

`prefix` (default): an approximate index of what each replica's prefix cache holds: the hashes
of the page-sized token blocks of the prompts sent there (each hash covers the whole prefix up
to its block, as a radix path does), at most `MAX_BLOCKS` per replica, least recently used
first out. A request goes to the replica whose index holds the most of its leading blocks,
unless the replicas' loads (requests in flight from this worker) differ by more than
--dp-load-threshold: then to the least loaded one. Ties (a new prefix) go to the least loaded,
then in turn. `round_robin` ignores prompts and loads (the ablation). The index only guesses
(a replica may have evicted a block, another worker may have sent the prefix elsewhere): a
wrong guess costs a prefill, never a wrong answer."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

MAX_BLOCKS = 1 << 16  # per replica: 64 K blocks of a page (16 tokens: 1 M tokens) each


def block_hashes(ids: Sequence[int], page_size: int) -> list[int]:
    """One hash per full page-sized block of `ids`, each covering every token up to its end."""
    hashes, h = [], 0
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hash((h, tuple(ids[start : start + page_size])))
        hashes.append(h)
    return hashes


class Dispatcher:
    def __init__(self, replicas: int, page_size: int, policy: str, load_threshold: int) -> None:
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"unknown dispatch policy {policy!r}: prefix or round_robin")
        if load_threshold < 0:
            raise ValueError(f"the dispatch load threshold must be >= 0, got {load_threshold}")
        self.page_size, self.policy, self.threshold = page_size, policy, load_threshold
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self.loads = [0] * replicas
        self.owner: dict[int, int] = {}  # uid -> replica, while in flight
        self.turn = itertools.cycle(range(replicas))

    def choose(self, ids: Sequence[int]) -> int:
        n = len(self.loads)
        if self.policy == "round_robin" or n == 1:
            return next(self.turn)
        least = min(self.loads)
        if max(self.loads) - least > self.threshold:
            return self._least_loaded()
        hashes = block_hashes(ids, self.page_size)
        matched = [self._matched(r, hashes) for r in range(n)]
        best = max(matched)
        if best == 0:
            return self._least_loaded()
        return min((r for r in range(n) if matched[r] == best), key=lambda r: self.loads[r])

    def _least_loaded(self) -> int:
        """The least loaded replica; among equals, the next in turn (spreads new prefixes)."""
        least = min(self.loads)
        for _ in range(len(self.loads)):
            r = next(self.turn)
            if self.loads[r] == least:
                return r
        raise AssertionError("unreachable: some replica has the least load")

    def _matched(self, replica: int, hashes: list[int]) -> int:
        blocks = self.blocks[replica]
        count = 0
        for h in hashes:
            if h not in blocks:
                break
            count += 1
        return count

    def sent(self, uid: int, replica: int, ids: Sequence[int]) -> None:
        """Request `uid` with prompt `ids` went to `replica`: its blocks are there now."""
        self.owner[uid] = replica
        self.loads[replica] += 1
        if self.policy != "prefix":
            return
        blocks = self.blocks[replica]
        for h in block_hashes(ids, self.page_size):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > MAX_BLOCKS:
            blocks.popitem(last=False)

    def replica_of(self, uid: int) -> int | None:
        return self.owner.get(uid)

    def done(self, uid: int) -> None:
        """Request `uid` ended (or never reached a replica): it no longer counts."""
        replica = self.owner.pop(uid, None)
        if replica is not None:
            self.loads[replica] -= 1
