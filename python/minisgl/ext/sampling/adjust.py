"""logit_bias, min_tokens and the repetition / frequency / presence penalties: a logits
processor (`LogitAdjust`) over a table of each request's settings by page-table row
(`AdjustTable`), applied to a step's rows at once on the device (`adjust_logits`; on CUDA the
fused kernel of `adjust_kernel.py`)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch

from minisgl import kernel
from minisgl.core import Req, check_token_ids, to_device
from minisgl.ext.sampling.params import adjusts_logits, uses_penalties
from minisgl.extension import StepFeature


class AdjustTable:
    """What each request adjusts its logits with, on the device by page-table row, written when
    the request is admitted (`write`), so that a step's adjustments need no per-request host
    work: penalty parameters, the prompt length, the position up to which min_tokens holds the
    stop ids back, and the logit_bias and stop entries (padded with id 0 and value 0; the
    columns grow with the longest). A row left by an adjusting request is made neutral for the
    next one (`clear`): a batch adjusts all its rows at once."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = device
        self.params = torch.tensor([[1.0, 0.0, 0.0]], device=device).repeat(rows, 1)
        self.lens = torch.zeros((rows, 2), dtype=torch.int64, device=device)
        self.bias_ids = torch.zeros((rows, 0), dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((rows, 0), dtype=torch.float32, device=device)
        self.stop_ids = torch.zeros((rows, 0), dtype=torch.int64, device=device)
        self.stop_values = torch.zeros((rows, 0), dtype=torch.float32, device=device)  # -inf
        self.dirty: set[int] = set()  # rows holding a request's non-neutral entries
        # the fused kernel's per-position penalty state (shaped as the token table, made at
        # its first use) and, on the host, the positions each row's state covers: the next
        # step's new positions, which set the kernel's parallelism
        self.firsts: torch.Tensor | None = None
        self.built = torch.zeros(rows, dtype=torch.int64, device=device)
        self.built_host: dict[int, int] = {}

    def write(self, row: int, req: Req, eos_token_ids: Collection[int]) -> None:
        p = req.params
        if not adjusts_logits(p):
            if row in self.dirty:
                self.clear(row)
            return
        self.dirty.add(row)
        if uses_penalties(p):  # a new request's positions: its state starts empty
            self.built[row] = 0
            self.built_host.pop(row, None)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        stops = stops if p.get("min_tokens") > 0 else set()
        bias = p.get("logit_bias")
        self.bias_ids, self.bias_values = _grown(self.bias_ids, self.bias_values, len(bias))
        self.stop_ids, self.stop_values = _grown(self.stop_ids, self.stop_values, len(stops))
        params = [
            p.get(name) for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        ]
        self.params[row] = to_device(params, torch.float32, self.device)
        self.lens[row] = to_device(
            [req.prompt_len, req.prompt_len + p.get("min_tokens")], torch.int64, self.device
        )
        self._set(self.bias_ids, row, list(bias))
        self._set(self.bias_values, row, list(bias.values()))
        self._set(self.stop_ids, row, sorted(stops))
        self._set(self.stop_values, row, [-math.inf] * len(stops))

    def clear(self, row: int) -> None:
        self.dirty.discard(row)
        self.params[row] = to_device([1.0, 0.0, 0.0], torch.float32, self.device)
        for t in (self.lens, self.bias_ids, self.bias_values, self.stop_ids, self.stop_values):
            t[row] = 0

    def track(
        self, token_table: torch.Tensor, penalized: Sequence[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The fused kernel's state for a step whose penalized rows see `penalized` (table row,
        positions) and the most new positions a row has (from the host's own count)."""
        if self.firsts is None:
            self.firsts = torch.empty_like(token_table)
        new = 0
        for row, seen in penalized:
            built = self.built_host.get(row, 0)
            new = max(new, seen - built if seen >= built else seen)
            self.built_host[row] = seen
        return self.firsts, self.built, new

    def _set(self, table: torch.Tensor, row: int, values: list) -> None:
        table[row] = 0
        if values:
            table[row, : len(values)] = to_device(values, table.dtype, self.device)


def _grown(
    ids: torch.Tensor, values: torch.Tensor, columns: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An (ids, values) table pair with at least `columns` columns (zero padded)."""
    pad = columns - ids.shape[1]
    if pad <= 0:
        return ids, values
    return torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(values, (0, pad))


def adjust_logits(
    logits: torch.Tensor,
    table: AdjustTable,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
    token_table: torch.Tensor,
    penalized: Sequence[tuple[int, int]],
) -> None:
    """In place, for every row of the batch (`rows`: their page-table rows, `kv_lens`: the
    positions being sampled), from the adjust table: add logit_bias, set to -inf the stop ids
    while min_tokens holds them back, then apply the penalties of the requests in `penalized`
    (table row, positions being sampled; the batch's rows whose penalties are not neutral).
    Neutral rows come out unchanged. On CUDA two launches (`adjust_kernel.py`, linear in the
    positions); this torch code is its reference."""
    penalty_length = max((seen for _, seen in penalized), default=0)
    ops = kernel.fused_ops(logits, "minisgl.ext.sampling.adjust_kernel")
    if ops is not None and logits.stride(-1) == 1:
        bias, stops = (table.bias_ids, table.bias_values), (table.stop_ids, table.stop_values)
        track = table.track(token_table, penalized)
        ops.adjust_logits(
            logits, rows, kv_lens, table.params, table.lens, bias, stops, token_table, track,
            penalty_length,
        )  # fmt: skip
        return
    if table.bias_ids.shape[1]:
        values = table.bias_values[rows].to(logits.dtype)
        logits.scatter_add_(1, table.bias_ids[rows], values)
    if table.stop_ids.shape[1]:
        held = (kv_lens < table.lens[rows, 1])[:, None]
        values = torch.where(held, table.stop_values[rows], 0.0).to(logits.dtype)
        logits.scatter_add_(1, table.stop_ids[rows], values)
    if penalty_length:
        apply_penalties(logits, table, rows, kv_lens, token_table, penalty_length)


def apply_penalties(
    logits: torch.Tensor,
    table: AdjustTable,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
    token_table: torch.Tensor,
    length: int,
) -> None:
    """Repetition, frequency and presence penalties over each request's own tokens (read from
    the token table up to the position being sampled), touching only the logits of tokens seen:
    [rows, length] gathers and scatters, no [rows, vocab] work, no host sync."""
    repetition, frequency, presence = table.params[rows].T[:, :, None]
    batch_row = torch.arange(len(rows), device=logits.device)[:, None]
    table_row, kv_len = rows[:, None], kv_lens[:, None]
    prompt_len = table.lens[rows, :1]
    position = torch.arange(length, device=logits.device)[None, :]
    seen = position < kv_len  # the prompt and the output so far
    # past a request's end: its first token again, which the prompt holds (same values below)
    ids = torch.where(seen, token_table[table_row, position.clamp(max=token_table.shape[1] - 1)],
                      token_table[table_row, 0]).long()  # fmt: skip
    # each id's count in the output: sorted output ids (others beyond the vocabulary), searched
    output = seen & (position >= prompt_len)
    sorted_out = torch.where(output, ids, logits.shape[1]).sort(dim=1).values
    counts = torch.searchsorted(sorted_out, ids, right=True) - torch.searchsorted(sorted_out, ids)
    scores = logits[batch_row, ids].float()  # duplicates of an id read (and write) the same
    scores = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores -= frequency * counts + presence * (counts > 0)
    logits[batch_row.expand_as(ids), ids] = scores.to(logits.dtype)


def grammar_over_min_tokens(logits: torch.Tensor, grammar_only: torch.Tensor) -> None:
    """In place: rows the adjustments left without a finite logit go back to `grammar_only`
    (the logits after the grammar's mask alone). That happens when the grammar allows only its
    end (the text is complete) while min_tokens still holds the stop ids back: the grammar
    wins and the request stops there, instead of sampling a token the grammar refuses. No
    host sync."""
    dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
    torch.where(dead, grammar_only, logits, out=logits)


class LogitAdjust(StepFeature):
    """The step feature: a request that adjusts its logits has `ext["adjust"]`; its settings
    go into the table when it is admitted, and a step with one adjusts all its rows (neutral
    rows come out unchanged) after any mask (stage 1)."""

    name, stage, changes_logits = "adjust", 1, True

    def __init__(self, scheduler: Any) -> None:
        engine = scheduler.engine
        self.scheduler = scheduler  # its eos_token_ids at admission: what min_tokens holds back
        self.vocab = engine.model_config.vocab_size
        self.table = AdjustTable(engine.config.max_running_requests + 1, engine.device)

    def request(self, req: Req) -> None:
        check_token_ids(self.vocab, logit_bias=list(req.params.get("logit_bias")))
        if adjusts_logits(req.params):
            req.ext[self.name] = True

    def admitted(self, req: Req) -> None:
        self.table.write(req.table_idx, req, self.scheduler.eos_token_ids)

    def process(self, engine: Any, batch: Any, out: Any, prepared: Any, masked: bool) -> bool:
        """`masked`: a grammar masked some rows first; a row these adjustments leave with no
        finite logit goes back to its masked logits (`grammar_over_min_tokens`)."""
        penalized = [
            (r.table_idx, r.cached_len + r.extend_len)
            for r in batch.reqs
            if self.name in r.ext and uses_penalties(r.params)
        ]
        logits = out.logits
        masked_only = logits.clone() if masked else None
        adjust_logits(
            logits, self.table, out.inputs.rows, out.inputs.kv_lens, engine.token_table, penalized
        )
        if masked_only is not None:
            grammar_over_min_tokens(logits, masked_only)
        return False
