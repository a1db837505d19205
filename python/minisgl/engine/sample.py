"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness comes from a counter-based hash of (seed, step, token id) instead of a stateful
generator, so a seeded request samples the same tokens whatever batch it lands in, on any
device, and the whole batch is sampled with tensor ops and no host sync."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from minisgl import kernel
from minisgl.core import Req, to_device

MASK32 = 0xFFFFFFFF


@dataclass
class BatchSamplingArgs:
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, vocab size when off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64: position of the token being sampled
    all_greedy: bool
    need_filter: bool  # some request uses top-k / top-p / min-p

    @staticmethod
    def from_reqs(
        reqs: list[Req], vocab_size: int, device: torch.device, steps: list[int] | None = None
    ) -> BatchSamplingArgs:
        """One row per request; `steps`: the position each row samples at (default: after the
        request's tokens; a request repeated over positions when verifying proposals)."""
        params = [r.params for r in reqs]
        steps = [len(r.tokens) for r in reqs] if steps is None else steps
        temps = [0.0 if p.is_greedy else p.temperature for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        data = to_device(
            [[t, p.top_p, p.min_p] for t, p in zip(temps, params)], torch.float32, device
        )
        ints = to_device(
            [[k, r.seed, s] for k, r, s in zip(top_k, reqs, steps)], torch.int64, device
        )
        return BatchSamplingArgs(
            temperature=data[:, 0],
            top_k=ints[:, 0],
            top_p=data[:, 1],
            min_p=data[:, 2],
            seed=ints[:, 1],
            step=ints[:, 2],
            all_greedy=all(t == 0.0 for t in temps),
            need_filter=any_filter(reqs, vocab_size),
        )


def any_filter(reqs: list[Req], vocab_size: int) -> bool:
    """Whether some request samples with top-k, top-p or min-p."""
    return any(
        not p.is_greedy and (0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)
        for p in (r.params for r in reqs)
    )


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (values stay below 2**59 in int64, so no overflow)."""
    for _ in range(3):
        x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1) determined by (seed, step, token id) alone (23 random
    bits each, so 1.0 is never reached)."""
    token = torch.arange(vocab_size, device=seed.device)
    row = _hash32((_hash32(seed & MASK32) ^ (step * 0x9E3779B1 & MASK32)) & MASK32)
    bits = _hash32((row[:, None] ^ (token[None, :] * 0x85EBCA6B & MASK32)) & MASK32)
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> argmax ids [B]. On CUDA in the model's dtype (a float32 copy adds
    nothing); on CPU in float32, where a bf16 argmax over a 49k vocabulary is 3x slower than
    the copy and a float32 argmax together (the same ids: widening is exact)."""
    return (logits.float() if logits.device.type == "cpu" else logits).argmax(dim=-1)


def sample(logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] (int64, on the logits' device). No host sync."""
    if args.all_greedy:
        return greedy(logits)
    filters = args if args.need_filter else None
    return sample_at_temperature(logits, args.temperature, args.seed, args.step, filters)


def sample_at_temperature(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    filters: BatchSamplingArgs | None = None,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy in the rows whose temperature is 0, a Gumbel-max draw at the row's temperature
    elsewhere, after top-k / top-p / min-p when `filters` is given. No host sync; without
    filters it is what CUDA graphs capture. `skip` [B]: rows whose id nobody reads (the fused
    kernel leaves them out and gives 0; elsewhere they are sampled all the same)."""
    if filters is None and (ops := kernel.fused_ops(logits, "sampling")) is not None:
        return ops.gumbel_argmax(logits, temperature, seed, step, skip)
    temp = torch.where(temperature > 0, temperature, 1.0)
    scores = logits.float() / temp[:, None]
    if filters is not None:
        scores = torch.log(_filter(torch.softmax(scores, dim=-1), filters))
    # Gumbel-max: argmax(log p + G), G = -log(-log U), draws a token with probability p.
    noise = uniform_noise(seed, step, scores.shape[-1])
    sampled = (scores - torch.log(-torch.log(noise))).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, logits.argmax(dim=-1))


def sample_into(
    table: torch.Tensor,
    rows: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sample_at_temperature` without filters, each id also written to table[rows, step] (the
    token table: a sampled id's position is its step). The fused kernel writes it where it
    picks the id, two small kernels fewer in every CUDA-graph step."""
    if (ops := kernel.fused_ops(logits, "sampling")) is not None:
        return ops.gumbel_argmax(logits, temperature, seed, step, skip, into=(table, rows))
    sampled = sample_at_temperature(logits, temperature, seed, step, skip=skip)
    table[rows, step] = sampled.to(table.dtype)
    return sampled


def _filter(probs: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p exclude (the top token always stays)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = rank >= args.top_k[:, None]
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > args.top_p[:, None]
    drop |= sorted_p < args.min_p[:, None] * sorted_p[:, :1]
    drop[:, 0] = False
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


@dataclass
class TokenMask:
    """Structured generation: the tokens allowed in some rows of a batch's logits. `bitmask`:
    int32 [B, ceil(V / 32)] in host memory (xgrammar's layout), bit 1 = allowed; `rows`: the
    rows it applies to."""

    bitmask: torch.Tensor
    rows: list[int]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set to -inf, in the mask's rows of `logits`, the tokens whose bit is 0."""
    import xgrammar as xgr

    bitmask, rows = mask.bitmask, mask.rows
    bitmask = bitmask.to(logits.device, non_blocking=True)  # pinned by the scheduler on CUDA
    if logits.is_cuda:  # rows as a device tensor: xgrammar would copy a list from pageable memory
        indices = to_device(rows, torch.int32, logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)  # type: ignore[arg-type]
        return
    if logits.dtype == torch.float32:
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        return
    scratch = logits.float()  # xgrammar's CPU kernel takes float32 only
    xgr.apply_token_bitmask_inplace(scratch, bitmask, indices=rows)
    logits.copy_(scratch)


def grammar_over_min_tokens(logits: torch.Tensor, grammar_only: torch.Tensor) -> None:
    """In place: rows the adjustments left without a finite logit go back to `grammar_only`
    (the logits after the grammar's mask alone). That happens when the grammar allows only its
    end (the text is complete) while min_tokens still holds the stop ids back: the grammar
    wins and the request stops there, instead of sampling a token the grammar refuses. No
    host sync."""
    dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
    torch.where(dead, grammar_only, logits, out=logits)


def any_adjusted(reqs: list[Req]) -> bool:
    """Whether some request adjusts its logits (penalties, logit_bias, min_tokens)."""
    return any(r.params.adjusts_logits for r in reqs)


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
        if not p.adjusts_logits:
            if row in self.dirty:
                self.clear(row)
            return
        self.dirty.add(row)
        if p.uses_penalties:  # a new request's positions: its state starts empty
            self.built[row] = 0
            self.built_host.pop(row, None)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        stops = stops if p.min_tokens > 0 else set()
        self.bias_ids, self.bias_values = _grown(self.bias_ids, self.bias_values, len(p.logit_bias))
        self.stop_ids, self.stop_values = _grown(self.stop_ids, self.stop_values, len(stops))
        params = [p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
        self.params[row] = to_device(params, torch.float32, self.device)
        self.lens[row] = to_device(
            [req.prompt_len, req.prompt_len + p.min_tokens], torch.int64, self.device
        )
        self._set(self.bias_ids, row, list(p.logit_bias))
        self._set(self.bias_values, row, list(p.logit_bias.values()))
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
    Neutral rows come out unchanged. On CUDA two launches (`kernel/adjust.py`, linear in the
    positions); this torch code is its reference."""
    penalty_length = max((seen for _, seen in penalized), default=0)
    ops = kernel.fused_ops(logits, "adjust")
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
