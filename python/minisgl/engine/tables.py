"""Writes to the page table and the token table (ext/perf's `QueuedTableWrites` holds them and
sends a step's all at its head, in one copy and one kernel)."""

from __future__ import annotations

import torch


class TableWrites:
    """Each write sent as it comes, behind the work already queued on the device (from pinned
    memory on CUDA, so that the copy does not wait for that work)."""

    def __init__(self, page_table: torch.Tensor, token_table: torch.Tensor) -> None:
        self.page_table, self.token_table = page_table, token_table

    def write_pages(self, row: int, start: int, pages: list[int]) -> None:
        self._write(self.page_table, row, start, pages)

    def write_tokens(self, row: int, start: int, tokens: list[int]) -> None:
        self._write(self.token_table, row, start, tokens)

    def flush(self) -> None:
        """Send the writes held back (here none)."""

    @staticmethod
    def _write(table: torch.Tensor, row: int, start: int, values: list[int]) -> None:
        host = torch.tensor(values, dtype=table.dtype, pin_memory=table.is_cuda)
        table[row, start : start + len(values)] = host.to(table.device, non_blocking=True)
