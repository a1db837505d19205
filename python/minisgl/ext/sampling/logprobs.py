"""Log-probabilities of sampled tokens and of prompt tokens, each with its top alternatives.

They are the model's own distribution: the log-softmax of the raw logits, before temperature,
penalties, logit_bias and grammar masks (vLLM's default, `raw_logprobs`), so a token's
log-probability does not depend on how it was sampled. All on the device, no host sync; the
results travel to the host with the step's sampled ids. Two step features: `Logprobs`
(SamplingParams.logprobs, an observer of a step's raw logits) and `PromptLogprobs`'s
`PromptScoring` (prompt_logprobs, an observer of a prefill's hidden states)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minisgl import kernel
from minisgl.core import Batch, Req, to_device
from minisgl.extension import StepFeature

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.engine.step import ForwardOutput

PROMPT_SLICE = 512  # prompt positions projected onto the vocabulary at once (bounds memory)
# one position on the host: (log-probability of its token, top ids, their log-probabilities)
Entry = tuple[float, list[int], list[float]]


@dataclass
class LogprobRows:
    """For M rows: the log-probability of each row's target token and its top-k alternatives."""

    chosen: torch.Tensor  # [M] float32
    top_ids: torch.Tensor  # [M, K] int64
    top_values: torch.Tensor  # [M, K] float32

    @staticmethod
    def of(
        logits: torch.Tensor, targets: torch.Tensor, k: int, rows: torch.Tensor | None = None
    ) -> LogprobRows:
        """log p = logit - logsumexp(logits) for the rows `rows` of logits (all when None; an
        index, so the caller copies nothing) and their targets [M]. On CUDA one read of the
        logits (`logprobs_kernel.py`); this torch code is its reference: the top-k found on the
        logits themselves (the same order), so no [M, V] log-softmax is written."""
        ops = kernel.fused_ops(logits, "minisgl.ext.sampling.logprobs_kernel")
        if ops is not None and k <= ops.MAX_K:
            return LogprobRows(*ops.logprob_rows(logits, targets, k, rows))
        if rows is not None:
            logits = logits[rows]
        lse = torch.logsumexp(logits.float(), dim=-1)
        chosen = logits.gather(1, targets[:, None].long()).squeeze(1).float() - lse
        top_values, top_ids = logits.topk(k, dim=-1)  # k = 0: empty [M, 0]
        return LogprobRows(chosen, top_ids, top_values.float() - lse[:, None])

    @staticmethod
    def cat(parts: list[LogprobRows]) -> LogprobRows:
        return LogprobRows(
            torch.cat([p.chosen for p in parts]),
            torch.cat([p.top_ids for p in parts]),
            torch.cat([p.top_values for p in parts]),
        )

    def to_host(self) -> LogprobRows:
        """Queue the copies into pinned host memory (the caller records the event to wait on)."""
        if not self.chosen.is_cuda:
            return self

        def copy(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        return LogprobRows(copy(self.chosen), copy(self.top_ids), copy(self.top_values))

    def entries(self, ks: list[int]) -> list[Entry]:
        """Host entries, row i keeping its own top ks[i] (the batch computed the largest k):
        three `tolist` calls and, when every row asks for the batch's k (the usual case), no
        per-row work beyond the tuple `zip` makes."""
        chosen, ids, values = self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        k = self.top_ids.shape[1]
        if all(n == k for n in ks):
            return list(zip(chosen, ids, values))
        return [(c, i[:n], v[:n]) for c, i, v, n in zip(chosen, ids, values, ks)]


@dataclass
class SampledLogprobs:
    """Log-probabilities of the tokens sampled in some rows of a batch: `rows` (host), the
    raw logits they are computed from and, once sampled, the results."""

    rows: list[int]
    ks: list[int]
    index: torch.Tensor | None  # `rows` on the device; None: every row of the batch
    # the step's [B, V] logits, or a [M, V] copy of the rows' raw logits (`copied`) when the
    # step adjusts or masks the logits in place before sampling
    logits: torch.Tensor
    copied: bool
    result: LogprobRows | None = None

    @staticmethod
    def start(batch: Batch, logits: torch.Tensor, copy: bool) -> SampledLogprobs | None:
        """Call before anything changes `logits`; `copy`: something will (a copy of the asking
        rows then keeps the raw values; else they are read in place, after sampling)."""
        rows = [i for i, r in enumerate(batch.reqs) if "logprobs" in r.params.ext]
        if not rows:
            return None
        ks = [batch.reqs[i].params.ext["logprobs"] or 0 for i in rows]
        index = None if len(rows) == batch.size else to_device(rows, torch.int64, logits.device)
        if copy:
            logits = logits.clone() if index is None else logits[index]
        return SampledLogprobs(rows, ks, index, logits, copy)

    def finish(self, next_ids: torch.Tensor) -> None:
        targets = next_ids if self.index is None else next_ids[self.index]
        rows = None if self.copied else self.index
        self.result = LogprobRows.of(self.logits, targets, max(self.ks), rows).to_host()


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens computed by a prefill step: `spans` (host) gives, per
    batch row, the first prompt position covered and how many follow."""

    spans: list[tuple[int, int, int]]  # (batch row, first target position, count)
    ks: list[int]  # per target position
    result: LogprobRows

    def finish(self, next_ids: torch.Tensor) -> None:
        """Queued already: the sampled ids play no part (an `Observation`)."""

    @staticmethod
    def compute(engine: Engine, batch: Batch, hidden: torch.Tensor) -> PromptLogprobs | None:
        """For each request that asks, the positions of its prompt whose logits this step
        computes and whose log-probability is not known yet (chunks and re-prefills after a
        preemption compute each position once). Projected onto the vocabulary in slices."""
        spans: list[tuple[int, int, int]] = []
        flat: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        offset = 0
        for i, req in enumerate(batch.reqs):
            c, k = req.cached_len, req.params.get("prompt_logprobs")
            state = req.ext.get(PromptScoring.name)
            if state is None:
                offset += req.extend_len
                continue
            # the logits at position t - 1 give the log-probability of token t
            first = max(c + 1, state.next)
            end = min(c + req.extend_len + 1, req.prompt_len)
            if k is not None and first < end:
                state.next = end  # known once queued: a re-prefill (preemption) skips them
                spans.append((i, first, end - first))
                flat += range(offset + first - 1 - c, offset + end - 1 - c)
                targets += req.tokens[first:end]
                ks += [k] * (end - first)
            offset += req.extend_len
        if not spans:
            return None
        device, k_max = hidden.device, max(ks)
        flat_t, targets_t = to_device([flat, targets], torch.int64, device)
        parts = []
        for s in range(0, len(flat), PROMPT_SLICE):
            logits = engine.model.compute_logits(hidden[flat_t[s : s + PROMPT_SLICE]])
            parts.append(LogprobRows.of(logits, targets_t[s : s + PROMPT_SLICE], k_max))
        return PromptLogprobs(spans, ks, LogprobRows.cat(parts).to_host())

    def by_row(self) -> dict[int, list[Entry]]:
        """The host entries of each batch row (after the step's copy is done)."""
        entries = self.result.entries(self.ks)
        out, start = {}, 0
        for row, _, count in self.spans:
            out[row] = entries[start : start + count]
            start += count
        return out


class Logprobs(StepFeature):
    """SamplingParams.logprobs: read from each step's raw logits before any processor."""

    name = "logprobs"

    def request(self, req: Req) -> None:
        if "logprobs" in req.params.ext:
            req.ext[self.name] = True

    def observe(self, engine: Any, batch: Batch, out: ForwardOutput) -> SampledLogprobs | None:
        return SampledLogprobs.start(batch, out.logits, out.changes)

    def read(self, reqs: list[Req], result: SampledLogprobs) -> list[Entry | None] | None:
        """Per batch row, the sampled token's entry when the request asked for logprobs."""
        if result.result is None:
            return None
        entries: list[Entry | None] = list(result.result.entries(result.ks))
        if result.index is None:  # every row asked
            return entries
        out: list[Entry | None] = [None] * len(reqs)
        for row, entry in zip(result.rows, entries):
            out[row] = entry
        return out

    def output(self, req: Req, value: Entry | None, output: Any) -> None:
        output.ext["logprob"] = value

    def result(self, req: Req, outputs: list[Any]) -> dict[str, Any]:
        outputs = [o for o in outputs if o.ext.get("logprob") is not None]
        entries = [[(o.token_ids or [None])[0], *o.ext["logprob"]] for o in outputs]
        return {"logprobs": logprob_dicts(entries)}


@dataclass
class PromptState:
    """A request's prompt_logprobs: the next prompt position whose log-probability is not
    computed yet, the entries computed so far, and whether they went out (with its first
    output)."""

    next: int = 1
    entries: list[Entry] = field(default_factory=list)
    sent: bool = False


class PromptScoring(StepFeature):
    """SamplingParams.prompt_logprobs: computed from the hidden states of the eager prefill
    steps (each position once: chunks and re-prefills after a preemption skip what is known,
    and the prefix cache never supplies a position still to compute); sent with the first
    output, as [token id, logprob | None, top ids, top logprobs] per prompt token."""

    name, scores_prompt = "prompt_logprobs", True

    def request(self, req: Req) -> None:
        if "prompt_logprobs" in req.params.ext:
            req.ext[self.name] = PromptState()

    def accept(self, req: Req, token: int, reason: str | None) -> tuple[str | None, str | None]:
        """max_tokens=0 (a prompt scored): its prefill's sampled token ends it, dropped."""
        return ("length" if req.params.max_tokens == 0 else reason), None

    def prefix_limit(self, req: Req) -> int:
        return req.ext[self.name].next - 1

    def observe(self, engine: Any, batch: Batch, out: ForwardOutput) -> PromptLogprobs | None:
        """An eager prefill's (the one step that keeps every token's hidden states)."""
        if batch.is_decode or out.hidden is None:
            return None
        return PromptLogprobs.compute(engine, batch, out.hidden)

    def read(self, reqs: list[Req], result: PromptLogprobs) -> None:
        for i, entries in result.by_row().items():  # prompt positions this step scored
            reqs[i].ext[self.name].entries += entries
        return None

    def output(self, req: Req, value: Any, output: Any) -> None:
        if req.params.max_tokens == 0:  # the sampled token is not the request's
            output.token_ids = []
            del req.tokens[req.prompt_len :]
        state = req.ext[self.name]
        if state.sent:
            return
        state.sent = True
        first: list[Any] = [req.tokens[0], None, [], []]  # nothing predicts the first token
        targets = req.tokens[1 : req.prompt_len]
        output.ext["prompt_logprobs"] = [first, *([t, *e] for t, e in zip(targets, state.entries))]
        state.entries = []

    def result(self, req: Req, outputs: list[Any]) -> dict[str, Any]:
        entries: list[Any] = next(
            (e for o in outputs if (e := o.ext.get("prompt_logprobs")) is not None), []
        )
        return {"prompt_logprobs": logprob_dicts(entries)}


def logprob_dicts(entries: list[list[Any]]) -> list[dict[int, float] | None]:
    """`LLM`'s results in vLLM's shape, per position: token id -> log-probability, the top
    alternatives and the token itself; None where nothing predicts the token (a prompt's
    first)."""
    dicts: list[dict[int, float] | None] = []
    for token, logprob, top_ids, top_logprobs in entries:
        top = dict(zip(top_ids, top_logprobs))
        top[token] = logprob  # in place: no second dict per position
        dicts.append(None if logprob is None else top)
    return dicts
