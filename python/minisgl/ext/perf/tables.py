"""Page-table and token-table writes queued on the host and sent at a step's head, in one copy
and one kernel for all (the `table_writes` point; the core's `engine.tables.TableWrites` sends
each as it comes)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from minisgl import kernel
from minisgl.engine.tables import TableWrites


@dataclass
class _Queue:
    """One table's queued writes (row, first column, values) and the spans queued per row."""

    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    values: array = field(default_factory=lambda: array("i"))  # int32, as the tables
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def overlaps(self, row: int, start: int, end: int) -> bool:
        return any(s < end and start < e for s, e in self.spans.get(row, ()))

    def clear(self) -> None:
        self.rows, self.starts, self.lengths, self.spans = [], [], [], {}
        self.values = array("i")

    def add(self, row: int, start: int, values: list[int]) -> None:
        self.spans.setdefault(row, []).append((start, start + len(values)))
        self.rows.append(row)
        self.starts.append(start)
        self.lengths.append(len(values))
        self.values.fromlist(values)  # a third of the time torch.tensor takes over a list


def entries(writes: list[_Queue], pin: bool) -> torch.Tensor:
    """[3, n] int32 host tensor (row, column, value) of every queued entry, pinned if `pin`.
    Expanded in numpy: torch's CPU repeat_interleave took 4-9 ms a call on an H100 host."""
    rows = np.array([r for q in writes for r in q.rows], dtype=np.int64)
    starts = np.array([s for q in writes for s in q.starts], dtype=np.int64)
    lengths = np.array([n for q in writes for n in q.lengths], dtype=np.int64)
    values = np.frombuffer(sum((q.values for q in writes), array("i")), dtype=np.int32)
    # pinned: a copy from pageable memory would wait for the work queued before it
    out = torch.empty((3, len(values)), dtype=torch.int32, pin_memory=pin)
    host = out.numpy()  # written in place: no copy into the pinned memory after
    host[0] = np.repeat(rows, lengths)
    # entry i of write w sits at column starts[w] + i - (entries before w)
    shift = starts - (np.cumsum(lengths) - lengths)
    host[1] = np.arange(len(values)) + np.repeat(shift, lengths)
    host[2] = values
    return out


class QueuedTableWrites(TableWrites):
    """Writes to the page table and the token table, held on the host until `flush` at the head
    of each step: one copy and one kernel for all (one by one, each paid two copies with idle
    gaps). A write that overlaps one still queued sends the queue first: the later wins."""

    def __init__(self, page_table: torch.Tensor, token_table: torch.Tensor) -> None:
        assert page_table.dtype == token_table.dtype == torch.int32
        super().__init__(page_table, token_table)
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
        device = self.page_table.device
        host = entries([pages, tokens], pin=device.type == "cuda")
        n_pages = len(pages.values)
        pages.clear()
        tokens.clear()
        sent = send(host, device)
        if (ops := kernel.fused_ops(sent)) is not None:
            ops.write_table_entries(self.page_table, self.token_table, sent, n_pages)
            return
        rows, cols = sent[0].long(), sent[1].long()  # the reference
        self.page_table[rows[:n_pages], cols[:n_pages]] = sent[2, :n_pages]
        self.token_table[rows[n_pages:], cols[n_pages:]] = sent[2, n_pages:]


def send(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The queued entries' one host-to-device copy (tests count them)."""
    return host.to(device, non_blocking=True)
