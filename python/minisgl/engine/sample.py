"""Batched sampling: greedy, temperature, top-k, top-p, min-p. The randomness is a hash of
(seed, step, token id), not a stateful generator: a seeded request samples alike in any batch,
on any device, with no host sync."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from minisgl import kernel
from minisgl.core import Req, to_device

MASK32 = 0xFFFFFFFF


@dataclass
class Filters:
    """The top-k, top-p and min-p of a batch's rows (a row without one: vocab size, 1, 0)."""

    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32

    @staticmethod
    def of(reqs: list[Req], vocab_size: int, device: torch.device) -> Filters:
        """A row per request (copied without blocking the host)."""
        params = [r.params for r in reqs]
        floats = [[p.top_p for p in params], [p.min_p for p in params]]
        top_p, min_p = to_device(floats, torch.float32, device)
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        return Filters(to_device(top_ks, torch.int64, device), top_p, min_p)


def any_filter(reqs: list[Req], vocab_size: int) -> bool:
    """Whether some request samples with top-k, top-p or min-p."""
    return any(
        not p.is_greedy and (0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)
        for p in (r.params for r in reqs)
    )


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int32 bit patterns (products wrap mod 2**32)."""
    # `>> 16 & 0xFFFF`: the logical shift. int32, not int64: half the bytes a pass over [B, V]
    # (the CPU's sampling is a pass per op; 1.6x faster at one row, 3.7x at 8)
    for _ in range(3):
        x = (x >> 16).bitwise_and_(0xFFFF).bitwise_xor_(x).mul_(0x45D9F3B)
    return (x >> 16).bitwise_and_(0xFFFF).bitwise_xor_(x)


@functools.cache
def _token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(vocab_size, device=device) * 0x85EBCA6B).to(torch.int32)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1) from (seed, step, token id) alone (23 random bits)."""
    # int64 -> int32 keeps the low 32 bits (their uint32 value's int32 pattern)
    row = _hash32(_hash32(seed.to(torch.int32)) ^ (step * 0x9E3779B1).to(torch.int32))
    bits = _hash32(row[:, None] ^ _token_keys(vocab_size, seed.device)[None, :])
    return (bits >> 9).bitwise_and_(0x7FFFFF).float().add_(0.5).mul_(2.0**-23)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> argmax ids [B]; on CPU in float32."""
    # a bf16 argmax on CPU is 3x slower than widening (exact) and a float32 argmax together
    return (logits.float() if logits.device.type == "cpu" else logits).argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    filters: Filters | None = None,
    skip: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] (int64, on the logits' device), with no host sync:
    greedy where the temperature is 0, else a Gumbel-max draw at it (after `filters`). `step`:
    the position each row samples at; `skip` [B]: rows whose id nobody reads (the fused kernel
    gives 0 there); `into` (table, rows): each id also written to table[rows, step]."""
    # (the fused kernel writes an id where it picks it: two kernels fewer a graph step; a
    # CPU_OPS sampler that TAKES_FILTERS, ext/cpu's, draws filtered rows too)
    ops = kernel.fused_ops(logits, "sampling")
    if ops is not None and (filters is None or ops.TAKES_FILTERS):
        return ops.gumbel_argmax(logits, temperature, seed, step, skip, into=into, filters=filters)
    scores = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if filters is not None:
        scores = torch.log(_filter(torch.softmax(scores, dim=-1), filters))
    # Gumbel-max: argmax(log p + G), G = -log(-log U), draws a token with probability p.
    scores -= uniform_noise(seed, step, scores.shape[-1]).log_().neg_().log_()
    sampled = torch.where(temperature > 0, scores.argmax(dim=-1), greedy(logits))
    if into is not None:
        table, rows = into
        table[rows, step] = sampled.to(table.dtype)
    return sampled


def _filter(probs: torch.Tensor, args: Filters) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p exclude (the top token always stays)."""
    # stable: of equal probabilities at a cut the lower token ids stay (as in ext/cpu's sampler)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = rank >= args.top_k[:, None]
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > args.top_p[:, None]
    drop |= sorted_p < args.min_p[:, None] * sorted_p[:, :1]
    drop[:, 0] = False
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
