"""Speculative decoding, the engine's side: the target model's token at every position of the
rows that verify proposals, sampled as a plain decode step would sample it there (same logits,
same temperature and filters, same per-(seed, position) noise). The scheduler compares them
with the proposals (`speculator.accept`). All on the device; the tokens go to the host with the
step's sampled ids. A verifying row is a running request (a decode row of the batch) that
computes more than one token: its last known token and its proposals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch, Req, to_device
from minisgl.engine.sample import Filters, any_filter, sample
from minisgl.ext.perf.prefill_rows import rows_per_position, samples_plainly
from minisgl.extension import ForwardPath

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.engine.step import ForwardOutput

RESULT = "spec"  # the verification's key in a step's results (Speculator.name)


def verifying_rows(batch: Batch) -> list[int]:
    """The batch rows that verify: decode rows (running requests) computing several tokens."""
    if batch.is_decode:
        return []
    return [i for i in range(batch.num_decodes) if batch.reqs[i].extend_len > 1]


@dataclass
class Verification:
    """For the batch rows `rows` that verify: `counts[i]` tokens each (the last known token
    and the proposals), whose target tokens `targets` holds flat, in row order."""

    rows: list[int]
    counts: list[int]
    targets: torch.Tensor

    @staticmethod
    def start(engine: Engine, batch: Batch, out: ForwardOutput) -> Verification | None:
        rows = verifying_rows(batch)
        if not rows or out.hidden is None:
            return None
        flat: list[int] = []
        steps: list[int] = []
        reqs: list[Req] = []
        counts: list[int] = []
        offsets = [0]
        for req in batch.reqs:
            offsets.append(offsets[-1] + req.extend_len)
        for i in rows:
            req, n = batch.reqs[i], batch.reqs[i].extend_len
            flat += range(offsets[i], offsets[i] + n)
            reqs += [req] * n
            # the logits at position cached_len + j sample the token at index + 1
            steps += range(req.cached_len + 1, req.cached_len + 1 + n)
            counts.append(n)
        device = out.hidden.device
        logits = engine.model.compute_logits(out.hidden[to_device(flat, torch.int64, device)])
        vocab = engine.model_config.vocab_size
        temps = to_device([r.params.sampling_temperature for r in reqs], torch.float32, device)
        seeds, steps_t = to_device([[r.seed for r in reqs], steps], torch.int64, device)
        filters = Filters.of(reqs, vocab, device) if any_filter(reqs, vocab) else None
        targets = sample(logits, temps, seeds, steps_t, filters)
        return Verification(rows, counts, targets)

    @staticmethod
    def from_flat(batch: Batch, ids: torch.Tensor) -> tuple[Verification | None, torch.Tensor]:
        """`ids`: a token per position of `flat_batch(batch)`. The verification of the rows
        that verify, and each row's token at its last position (its plain sample)."""
        lasts: list[int] = []
        picked: list[int] = []
        counts: list[int] = []
        rows = verifying_rows(batch)
        offset = 0
        for req in batch.reqs:
            offset += req.extend_len
            lasts.append(offset - 1)
        for i in rows:
            n = batch.reqs[i].extend_len
            counts.append(n)
            picked += range(lasts[i] + 1 - n, lasts[i] + 1)
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
    if not all(samples_plainly(r) for r in batch.reqs):
        return None
    return rows_per_position(batch)


class VerifyRows(ForwardPath):
    """The engine's path for steps with rows that verify: `flat_batch` steps replay the decode
    graphs, every row sampling, `regroup` giving each request its last row's id; the others run
    eagerly (unless not `eager`: a draft model's catch-up) and their regroup samples the target at
    every position of the rows that verify. Either queues the `Verification` in the results."""

    def __init__(self, eager: bool = True) -> None:
        self.eager = eager

    def forward(
        self, engine: Engine, batch: Batch, samples: list[bool], resample: bool
    ) -> ForwardOutput | None:
        if not verifying_rows(batch):
            return None
        if engine.graphs is None or (flat := flat_batch(batch, engine.graphs.max_bs)) is None:
            return self._eager(engine, batch, samples) if self.eager else None
        out = engine.graphs.replay(flat, [True] * flat.size, resample)

        def regroup(ids: torch.Tensor) -> torch.Tensor:
            verification, last = Verification.from_flat(batch, ids)
            if verification is not None:
                out.results[RESULT] = verification.to_host()
            return last

        out.rows, out.regroup = flat, regroup
        return out

    @staticmethod
    def _eager(engine: Engine, batch: Batch, samples: list[bool]) -> ForwardOutput:
        out = engine.eager(batch, samples)

        def regroup(ids: torch.Tensor) -> torch.Tensor:  # the ids as they are, then verify
            if (verification := Verification.start(engine, batch, out)) is not None:
                out.results[RESULT] = verification.to_host()
            return ids

        out.regroup = regroup
        return out
