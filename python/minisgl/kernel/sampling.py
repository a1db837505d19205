"""Fused Gumbel-max sampling: one pass over each row of logits, the noise generated in the
kernel from the same counter hash as `minisgl.engine.sample.uniform_noise`, so the result is
the torch path's (up to float rounding) without materialising a [B, V] noise tensor.

Imported only for CUDA tensors, so `import triton` stays off the CPU path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _hash32(x):
    for _ in tl.static_range(3):
        x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


@triton.jit
def _gumbel_argmax_kernel(
    logits,  # [B, V] float32
    temperature,  # [B] float32, 0 = greedy
    seed,  # [B] int64
    step,  # [B] int64
    out,  # [B] int64
    vocab_size,
    stride_b,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    temp = tl.load(temperature + b)
    greedy = temp == 0.0
    safe_temp = tl.where(greedy, 1.0, temp)
    s = tl.load(seed + b).to(tl.int64)
    st = tl.load(step + b).to(tl.int64)
    row_key = _hash32((_hash32(s & _MASK32) ^ (st * 0x9E3779B1 & _MASK32)) & _MASK32)
    best_val = -float("inf")
    best_idx = tl.zeros((), dtype=tl.int64)
    for block in range(tl.cdiv(vocab_size, BLOCK)):
        start = block * BLOCK
        offs = start + tl.arange(0, BLOCK)
        valid = offs < vocab_size
        x = tl.load(logits + b * stride_b + offs, mask=valid, other=-float("inf"))
        bits = _hash32((row_key ^ (offs.to(tl.int64) * 0x85EBCA6B & _MASK32)) & _MASK32)
        u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x / safe_temp + gumbel)
        score = tl.where(valid, score, -float("inf"))
        block_max = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0, tie_break_left=True)
        better = block_max > best_val  # strict: ties keep the first index, like torch.argmax
        best_idx = tl.where(better, start + block_idx.to(tl.int64), best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(out + b, best_idx)


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """argmax(logits / T + Gumbel noise) per row (argmax(logits) where T == 0) -> [B] int64."""
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    # the per-request arguments are often strided views of one [B, 3] tensor
    temperature, seed, step = temperature.contiguous(), seed.contiguous(), step.contiguous()
    _gumbel_argmax_kernel[(batch,)](
        logits, temperature, seed, step, out, vocab, logits.stride(0), BLOCK=2048, num_warps=8
    )
    return out
