"""Speculative decoding, the engine's side: the target model's token at every position of the
rows that carry proposals, sampled as a plain decode step would sample it there (same logits,
same temperature and filters, same per-(seed, position) noise). The scheduler compares them
with the proposals (scheduler/spec.py). All on the device; the tokens go to the host with the
step's sampled ids."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch, Req, to_device
from minisgl.engine.sample import BatchSamplingArgs, any_filter, sample, sample_at_temperature

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.engine.step import ForwardOutput


@dataclass
class Verification:
    """For the batch rows `rows` with proposals: `counts[i]` tokens each (the last known token
    and the proposals), whose target tokens `targets` holds flat, in row order."""

    rows: list[int]
    counts: list[int]
    targets: torch.Tensor

    @staticmethod
    def start(engine: Engine, batch: Batch, out: ForwardOutput) -> Verification | None:
        rows = [i for i, r in enumerate(batch.reqs) if r.drafts]
        if not rows or out.hidden is None:
            return None
        flat: list[int] = []
        steps: list[int] = []
        reqs: list[Req] = []
        counts: list[int] = []
        offset = 0
        for req in batch.reqs:
            if req.drafts:
                n = req.extend_len
                flat += range(offset, offset + n)
                reqs += [req] * n
                # the logits at position cached_len + j sample the token at index + 1
                steps += range(req.cached_len + 1, req.cached_len + 1 + n)
                counts.append(n)
            offset += req.extend_len
        device = out.hidden.device
        logits = engine.model.compute_logits(out.hidden[to_device(flat, torch.int64, device)])
        vocab = engine.model_config.vocab_size
        if any_filter(reqs, vocab):
            args = BatchSamplingArgs.from_reqs(reqs, vocab, device, steps)
            targets = sample(logits, args)
        else:
            temps = [0.0 if r.params.is_greedy else r.params.temperature for r in reqs]
            temps_t = to_device(temps, torch.float32, device)
            ints = to_device([[r.seed for r in reqs], steps], torch.int64, device)
            targets = sample_at_temperature(logits, temps_t, ints[0], ints[1])
        return Verification(rows, counts, targets)

    @staticmethod
    def from_flat(batch: Batch, ids: torch.Tensor) -> tuple[Verification | None, torch.Tensor]:
        """`ids`: a token per position of `flat_batch(batch)`. The verification of the rows
        with proposals, and each row's token at its last position (its plain sample)."""
        lasts: list[int] = []
        rows: list[int] = []
        picked: list[int] = []
        counts: list[int] = []
        offset = 0
        for i, req in enumerate(batch.reqs):
            if req.drafts:
                rows.append(i)
                counts.append(req.extend_len)
                picked += range(offset, offset + req.extend_len)
            offset += req.extend_len
            lasts.append(offset - 1)
        gathered = ids[to_device(lasts + picked, torch.int64, ids.device)]  # one copy in
        last, targets = gathered[: len(lasts)], gathered[len(lasts) :]
        return (Verification(rows, counts, targets) if rows else None), last

    def to_host(self) -> Verification:
        """Queue the copy into pinned host memory (the caller records the event to wait on)."""
        if not self.targets.is_cuda:
            return self
        host = torch.empty(self.targets.shape, dtype=self.targets.dtype, pin_memory=True)
        return Verification(self.rows, self.counts, host.copy_(self.targets, non_blocking=True))

    def by_row(self) -> dict[int, list[int]]:
        """Per batch row, the target's token at each of its positions (after the copy)."""
        flat, out, start = self.targets.tolist(), {}, 0
        for row, n in zip(self.rows, self.counts):
            out[row] = flat[start : start + n]
            start += n
        return out


def flat_batch(batch: Batch, max_rows: int) -> Batch | None:
    """A step of running requests that compute several known tokens each (proposals to
    verify, or a draft model catching up) as a decode batch with one row per position: the
    request at that position (a shallow copy). Row j attends to the KV that rows before it
    store in the same layer, so the logits are the extend's, and CUDA graphs can replay it.
    Each row samples as a plain decode there (its step is its position) and writes its id
    after its position in the token table, where the next row read its input before (inputs
    are gathered first); ids past what is accepted are overwritten later. None when the batch
    is not such a step, has more than `max_rows` positions, or a request samples otherwise
    (grammar, adjusted logits, logprobs)."""
    if batch.is_decode or batch.num_decodes != batch.size or batch.num_tokens > max_rows:
        return None
    if not all(r.samples_plainly for r in batch.reqs):
        return None
    return rows_per_position(batch)


def prefill_rows(batch: Batch, max_rows: int) -> Batch | None:
    """A small prefill or mixed step (at most `max_rows` tokens, no proposals) as a decode batch
    with one row per position, which CUDA graphs replay instead of an eager extend whose ~300
    kernel launches cost the host 12-25 ms (an idle H100 server's time to first token). Only
    each request's last row samples; the others write to the dummy row (`Engine._replay_rows`).
    Row j attends to the KV that rows before it store in the same layer, so each row's logits
    are the extend's at that position. None for requests that need every position's hidden
    state or logits afterwards (proposals, prompt logprobs) or sample otherwise than plainly."""
    if batch.is_decode or batch.num_tokens > max_rows:
        return None
    if not all(r.samples_plainly and not r.drafts for r in batch.reqs):
        return None
    # each row reads its whole prefix: a prompt's rows read ~n^2/2 positions where an extend
    # reads n, so long prefixes (a long prompt's last chunk, a long cached history) go eager
    if sum(prefix_reads(r) for r in batch.reqs if r.extend_len > 1) > ROWS_KV_READS:
        return None
    return rows_per_position(batch)


# How many KV positions the rows of a step's prompts may read together: a 512-token prompt's
# second 256-token chunk reads 98k. Measured on an H100 (Qwen3-0.6B): a 250-token prompt takes
# 4.5 ms as rows and ~15 ms as an eager extend; 512 tokens, two steps of rows, 9.3 ms.
ROWS_KV_READS = 128 * 1024


def prefix_reads(req: Req) -> int:
    """KV positions the rows of `req` read: cached_len + 1, cached_len + 2, ... each."""
    n = req.extend_len
    return n * req.cached_len + n * (n + 1) // 2


def rows_per_position(batch: Batch) -> Batch:
    rows = []
    for req in batch.reqs:
        for j in range(req.extend_len):
            row = copy.copy(req)
            row.cached_len, row.extend_len, row.drafts = req.cached_len + j, 1, []
            rows.append(row)
    return Batch(rows, "decode")
