"""Prompts as CUDA-graph rows: a small prefill or mixed step replayed in the decode graphs with
one row per position (`rows_per_position`) instead of an eager extend whose ~300
kernel launches cost the host 12-25 ms (an idle H100 server's time to first token), and the
planner's prompt budget that makes such steps fit the graphs while little waits."""

from __future__ import annotations

import copy
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import Batch, Req, to_device
from minisgl.ext.perf.options import perf_options
from minisgl.extension import ForwardPath

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.engine.step import ForwardOutput

# How many KV positions the rows of a step's prompts may read together: a 512-token prompt's
# second 256-token chunk reads 98k. Measured on an H100 (Qwen3-0.6B): a 250-token prompt takes
# 4.5 ms as rows and ~15 ms as an eager extend; 512 tokens, two steps of rows, 9.3 ms.
ROWS_KV_READS = 128 * 1024


def samples_plainly(req: Req) -> bool:
    """Its token at a position depends on the logits there alone, no extension acting on it
    (what graph rows and speculative decoding need)."""
    return not req.ext and req.params.ext.keys() <= {"priority"}


def prefix_reads(req: Req) -> int:
    """KV positions the rows of `req` read: cached_len + 1, cached_len + 2, ... each."""
    n = req.extend_len
    return n * req.cached_len + n * (n + 1) // 2


def rows_per_position(batch: Batch) -> Batch:
    """An extend as a decode batch of one row per computed position, which the graphs replay:
    row j attends to the KV the rows before it store (also ext/spec's verify path)."""
    rows = []
    for req in batch.reqs:
        for j in range(req.extend_len):
            row = copy.copy(req)
            row.cached_len, row.extend_len = req.cached_len + j, 1
            rows.append(row)
    return Batch(rows, "decode")


def prefill_rows(batch: Batch, max_rows: int) -> Batch | None:
    """A small prefill or mixed step (at most `max_rows` tokens, no proposals) as a decode batch
    with one row per position. Only each request's last row samples; the others write to the
    dummy row (`replay_rows`). Row j attends to the KV that rows before it store in the same
    layer, so each row's logits are the extend's at that position. None for requests that need
    every position's hidden state or logits afterwards (proposals to verify: a decode row
    computing several tokens; prompt logprobs) or sample otherwise than plainly."""
    if batch.is_decode or batch.num_tokens > max_rows:
        return None
    if any(batch.reqs[i].extend_len > 1 for i in range(batch.num_decodes)):
        return None
    if not all(samples_plainly(r) for r in batch.reqs):
        return None
    # each row reads its whole prefix: a prompt's rows read ~n^2/2 positions where an extend
    # reads n, so long prefixes (a long prompt's last chunk, a long cached history) go eager
    if sum(prefix_reads(r) for r in batch.reqs if r.extend_len > 1) > ROWS_KV_READS:
        return None
    return rows_per_position(batch)


def replay_rows(
    engine: Engine, batch: Batch, rows: Batch, samples: list[bool], resample: bool
) -> ForwardOutput:
    """`batch` replayed as `rows` (one per position, `prefill_rows`): each request's last row
    samples for it (to its own token-table row, as the eager step would), the others to the
    dummy row, so the prompt's tokens in the table stay. The outputs of the last rows, one per
    request, as the eager step gives them."""
    flags: list[bool] = []
    lasts: list[int] = []
    for req, samples_here in zip(batch.reqs, samples):
        flags += [False] * (req.extend_len - 1) + [samples_here]
        lasts.append(len(flags) - 1)
    assert engine.graphs is not None
    out = engine.graphs.replay(rows, flags, resample)
    return out.pick(to_device(lasts, torch.int64, engine.device))


class PrefillRows(ForwardPath):
    """Small prefill and mixed steps through the decode graphs of an engine (while it has
    them: CPU engines, and tests until they install a GraphRunner, do not)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def graph_rows(self) -> int:
        """How many tokens a step may hold to replay the graphs (0: never)."""
        graphs = self.engine.graphs
        return graphs.max_bs if graphs is not None else 0

    def forward(
        self, engine: Engine, batch: Batch, samples: list[bool], resample: bool
    ) -> ForwardOutput | None:
        if engine.graphs is None or (rows := prefill_rows(batch, engine.graphs.max_bs)) is None:
            return None
        return replay_rows(engine, batch, rows, samples, resample)

    def prefill_budget(
        self, planner: Any, budget: int, decodes: list[Req], num_decode_tokens: int
    ) -> int:
        """The prompt budget of a step, capped so that the step fits the graphs' rows when the
        prompts waiting fit in three such steps beside the decodes, none is longer than twice
        the graphs' rows with its cached prefix (the rows' KV reads stay within the limit),
        and the step could replay them (~300 fewer launches, ~10 ms less per step on an
        H100). A backlog, a long prompt's tail, or so many decodes that few rows are left
        keep the large eager chunks."""
        graph_rows = self.graph_rows
        rows = graph_rows - num_decode_tokens
        if rows <= 0 or budget <= rows or (planner.prefilling is None and not planner.waiting):
            return budget  # a decode-only step looks at no request here
        if not all(samples_plainly(r) and r.extend_len == 1 for r in decodes):
            return budget
        pending = [planner.prefilling] if planner.prefilling is not None else []
        total = 0
        for req in chain(pending, planner.waiting):
            total += req.remaining_len
            if total > 3 * rows or len(req.tokens) > 2 * graph_rows:
                return budget
            if not samples_plainly(req):
                return budget
        return rows


def make_prefill_rows(scheduler: Any) -> PrefillRows | None:
    """The path of a scheduler's engine, unless --disable-prefill-graphs."""
    if perf_options(scheduler.config).disable_prefill_graphs:
        return None
    return PrefillRows(scheduler.engine)
