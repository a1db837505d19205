"""ext/perf's QueuedTableWrites: page- and token-table writes queued on the host, sent in one
copy at a step's head (the torch reference path; the kernel is in tests/kernels); the core's
TableWrites, which sends each write as it comes."""

from __future__ import annotations

import pytest
import torch

from minisgl.engine.tables import TableWrites
from minisgl.ext.perf import tables
from minisgl.ext.perf.tables import QueuedTableWrites


def make(
    cls: type[TableWrites] = QueuedTableWrites,
) -> tuple[TableWrites, torch.Tensor, torch.Tensor]:
    pages = torch.full((4, 8), -1, dtype=torch.int32)
    tokens = torch.zeros((4, 32), dtype=torch.int32)
    return cls(pages, tokens), pages, tokens


def test_the_cores_writes_land_at_once_the_later_winning() -> None:
    writes, pages, tokens = make(TableWrites)
    writes.write_pages(1, 0, [5, 6, 7])
    writes.write_tokens(1, 2, [11, 12])
    writes.write_tokens(3, 2, [])  # nothing
    assert pages[1, :3].tolist() == [5, 6, 7] and tokens[1, :4].tolist() == [0, 0, 11, 12]
    writes.write_pages(1, 1, [9])
    writes.flush()  # nothing held back
    assert pages[1, :3].tolist() == [5, 9, 7]
    assert (pages == -1).sum() == 4 * 8 - 3 and (tokens != 0).sum() == 2


def count_copies(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = tables.send

    def counted(host, device):
        sizes.append(host.shape[1])
        return real(host, device)

    monkeypatch.setattr(tables, "send", counted)
    return sizes


@pytest.mark.ext
def test_writes_wait_for_the_flush_then_land_in_one_copy(monkeypatch):
    copies = count_copies(monkeypatch)
    writes, pages, tokens = make()
    writes.write_pages(1, 0, [5, 6, 7])
    writes.write_pages(2, 3, [9])
    writes.write_tokens(1, 0, [11, 12, 13, 14])
    writes.write_tokens(1, 4, [15])  # the same row, after the span before: no early send
    writes.write_tokens(3, 2, [])  # nothing
    assert (pages == -1).all() and (tokens == 0).all(), "sent before the step's head"
    writes.flush()
    assert copies == [9]
    assert pages[1, :3].tolist() == [5, 6, 7] and pages[2, 3] == 9
    assert tokens[1, :5].tolist() == [11, 12, 13, 14, 15]
    assert (pages == -1).sum() == 4 * 8 - 4 and (tokens != 0).sum() == 5
    writes.flush()  # an empty queue sends nothing
    assert copies == [9]


@pytest.mark.ext
def test_an_overlapping_write_sends_the_queue_first_so_the_later_wins(monkeypatch):
    """Within one launch the order of two writes to one cell is undefined on a GPU: a write
    over a queued span sends the queue first."""
    copies = count_copies(monkeypatch)
    writes, pages, tokens = make()
    writes.write_tokens(0, 0, [1, 2, 3])
    writes.write_pages(0, 0, [4])  # another table: no overlap
    writes.write_tokens(0, 2, [30, 40])  # over position 2
    assert copies == [4]
    writes.write_pages(0, 0, [8])  # page 0 again: the first copy took page 4, none queued
    writes.write_pages(0, 0, [9])  # over page 0 queued just now
    writes.flush()
    assert copies == [4, 3, 1]
    assert tokens[0, :4].tolist() == [1, 2, 30, 40] and pages[0, 0] == 9


@pytest.mark.ext
def test_entries_expand_each_write_to_rows_and_columns_pages_first():
    pages, tokens = tables._Queue(), tables._Queue()
    tokens.add(2, 5, [7, 8, 9])
    pages.add(1, 0, [4])
    tokens.add(0, 0, [6])
    host = tables.entries([pages, tokens], pin=False)
    assert host.dtype == torch.int32
    assert host.tolist() == [[1, 2, 2, 2, 0], [0, 5, 6, 7, 0], [4, 7, 8, 9, 6]]
