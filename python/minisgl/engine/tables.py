"""Page-table and token-table writes, queued on the host and sent at a step's head."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl import kernel
from minisgl.core import to_device


@dataclass
class _Queue:
    """One table's queued entries, and the column spans queued per row."""

    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def overlaps(self, row: int, start: int, end: int) -> bool:
        return any(s < end and start < e for s, e in self.spans.get(row, ()))

    def clear(self) -> None:
        self.rows, self.cols, self.values, self.spans = [], [], [], {}

    def add(self, row: int, start: int, values: list[int]) -> None:
        self.spans.setdefault(row, []).append((start, start + len(values)))
        self.rows.extend([row] * len(values))
        self.cols.extend(range(start, start + len(values)))
        self.values.extend(values)


class TableWrites:
    """Writes to the page table (a request's pages) and the token table (its known tokens,
    proposals), held on the host until `flush`, which the engine calls at the head of each
    step: one host-to-device copy and one kernel for all of them. Written one by one, a decode
    step of 256 requests paid about 16 pages a step (one request in 16 crosses a page), each
    a host-to-device and a device-to-device copy with idle gaps between (session 30's
    timeline). A write that overlaps one still queued sends the queue first: the later wins."""

    def __init__(self, page_table: torch.Tensor, token_table: torch.Tensor) -> None:
        assert page_table.dtype == token_table.dtype == torch.int32
        self.page_table, self.token_table = page_table, token_table
        self.pages, self.tokens = _Queue(), _Queue()

    def write_pages(self, row: int, start: int, pages: list[int]) -> None:
        self._add(self.pages, row, start, pages)

    def write_tokens(self, row: int, start: int, tokens: list[int]) -> None:
        self._add(self.tokens, row, start, tokens)

    def _add(self, queue: _Queue, row: int, start: int, values: list[int]) -> None:
        if not values:
            return
        if queue.overlaps(row, start, start + len(values)):
            self.flush()
        queue.add(row, start, values)

    def flush(self) -> None:
        pages, tokens = self.pages, self.tokens
        if not pages.rows and not tokens.rows:
            return
        host = [pages.rows + tokens.rows, pages.cols + tokens.cols, pages.values + tokens.values]
        n_pages = len(pages.rows)
        pages.clear()
        tokens.clear()
        entries = to_device(host, torch.int32, self.page_table.device)
        if (ops := kernel.fused_ops(entries)) is not None:
            ops.write_table_entries(self.page_table, self.token_table, entries, n_pages)
            return
        rows, cols = entries[0].long(), entries[1].long()  # the reference
        self.page_table[rows[:n_pages], cols[:n_pages]] = entries[2, :n_pages]
        self.token_table[rows[n_pages:], cols[n_pages:]] = entries[2, n_pages:]
